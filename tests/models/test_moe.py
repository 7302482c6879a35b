"""The MoE block on one process: routing options, every expert path against a naive per-token reference (float64),
the grouped matmul against the loop, load statistics, the bias update, the sequence-wise aux loss and its
additivity over batch and sequence splits, and the per-expert init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import titanlike.models.moe as moe
from titanlike.init import generate, init_parameters, local_indices, plan_from_patterns
from titanlike.models.moe import (
    MoE,
    MoEArgs,
    aux_losses,
    expert_bias_update,
    expert_loads,
    pad_groups,
    param_init_patterns,
    reset_moe_stats,
    set_aux_loss_denominator,
    update_expert_biases,
)

BASE = MoEArgs(dim=16, hidden_dim=32, num_experts=8, top_k=2)
CONFIGS = {
    "softmax": BASE,
    "softmax renormalised, scaled, shared": BASE.replace(route_norm=True, route_scale=1.5, num_shared_experts=2),
    "sigmoid bias groups (deepseek)": BASE.replace(
        score_func="sigmoid", route_norm=True, route_scale=2.5, num_groups=4, topk_groups=2, load_balance_coeff=1e-3
    ),
    "top-3 of 6, 3 groups": BASE.replace(num_experts=6, top_k=3, num_groups=3, topk_groups=2),
}


def block(args: MoEArgs, seed: int = 0, dtype=torch.float64) -> MoE:
    m = MoE(args).to(dtype)
    m.init_weights(seed=seed, prefix="layers.1.moe.")
    if m.expert_bias is not None:  # a non-zero bias, so it changes the selection
        m.expert_bias.copy_(torch.linspace(-0.05, 0.05, args.num_experts, dtype=torch.float64))
    return m


def tokens(n_seq=3, seq=10, dim=16, seed=0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n_seq, seq, dim, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def naive(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the sum over its picked experts of weight x SwiGLU_e(x_t), plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    _, idx, weights = m.router(flat, m.expert_bias)
    e = m.experts
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros_like(flat[t])
        for j in range(idx.shape[1]):
            k = int(idx[t, j])
            acc = acc + weights[t, j] * ((F.silu(flat[t] @ e.w1[k].T) * (flat[t] @ e.w3[k].T)) @ e.w2[k].T)
        rows.append(acc)
    out = torch.stack(rows).view_as(x)
    return out + m.shared_experts(x) if m.shared_experts is not None else out


def grads(m: MoE, x: torch.Tensor, fn) -> dict[str, torch.Tensor]:
    m.zero_grad()
    x = x.clone().requires_grad_()
    (fn(x) * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum().backward()
    out = {n: p.grad.clone() for n, p in m.named_parameters()}
    out["input"] = x.grad
    return out


# ------------------------------------------------------------------------------------------ arguments, routing
def test_args_report_every_problem_in_one_message():
    with pytest.raises(ValueError) as e:
        MoEArgs(dim=16, hidden_dim=0, num_experts=6, top_k=7, num_groups=4, score_func="relu", route_scale=0)
    msg = str(e.value)
    for part in ("hidden_dim must be >= 1", "score_func", "route_scale", "top_k 7 exceeds num_experts 6",
                 "num_groups 4 does not divide num_experts 6"):  # fmt: skip
        assert part in msg, msg
    with pytest.raises(ValueError, match="top_k 5 exceeds the 4 experts of the topk_groups 2 groups"):
        MoEArgs(dim=8, hidden_dim=8, num_experts=8, top_k=5, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="load_balance_coeff must be > 0 or None"):
        MoEArgs(dim=8, hidden_dim=8, load_balance_coeff=0.0)


def identity_router(args: MoEArgs) -> MoE:
    """A block whose gate is the identity (dim = num_experts): the input rows are the router logits."""
    m = MoE(args).double()
    with torch.no_grad():
        m.router.gate.weight.copy_(torch.eye(args.num_experts, dtype=torch.float64))
    return m


def test_softmax_topk_weights_renormalisation_and_scale():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], dtype=torch.float64)
    probs = logits.softmax(-1)
    args = MoEArgs(dim=4, hidden_dim=4, num_experts=4, top_k=2)
    _, idx, w = identity_router(args).router(logits)
    assert idx.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(w, probs.gather(1, idx), rtol=0, atol=0)
    _, _, w = identity_router(args.replace(route_norm=True, route_scale=2.0)).router(logits)
    top = probs.gather(1, idx)
    torch.testing.assert_close(w, 2.0 * top / top.sum(-1, keepdim=True), rtol=0, atol=1e-15)


def test_the_bias_steers_the_selection_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    m = identity_router(MoEArgs(dim=4, hidden_dim=4, num_experts=4, top_k=1, score_func="sigmoid"))
    _, idx, w = m.router(logits)
    assert idx.tolist() == [[0]]
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0], dtype=torch.float64)  # sigmoid(.5) + .5 > sigmoid(2)
    _, idx, w = m.router(logits, bias)
    assert idx.tolist() == [[2]]
    assert w.item() == torch.sigmoid(torch.tensor(0.5, dtype=torch.float64)).item()  # the unbiased score


def test_group_limited_routing_picks_the_top_groups_first():
    # 3 groups of 2 experts: group 0 = (9, -9), group 1 = (5, -1), group 2 = (3, 2); a group's score is the sum of
    # its two best. The best expert (0) lies in the worst group: with one group allowed a token takes group 2's
    # experts, with two its best two of groups 1 and 2, with all three the plain top-2.
    logits = torch.tensor([[9.0, -9.0, 5.0, -1.0, 3.0, 2.0]], dtype=torch.float64)
    args = MoEArgs(dim=6, hidden_dim=4, num_experts=6, top_k=2, score_func="sigmoid", num_groups=3, topk_groups=1)
    picked = {g: sorted(identity_router(args.replace(topk_groups=g)).router(logits)[1][0].tolist()) for g in (1, 2, 3)}
    assert picked == {1: [4, 5], 2: [2, 4], 3: [0, 2]}
    assert _group_mask(logits.tolist(), 3, 2) == [False, False, True, True, True, True]


def _group_mask(choice, groups, keep):
    out = moe._limit_to_top_groups(torch.tensor(choice, dtype=torch.float64), groups, keep)
    return torch.isfinite(out)[0].tolist()


# ------------------------------------------------------------------------------------------ the expert paths
@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_equals_the_naive_per_token_reference_in_float64(name):
    args = CONFIGS[name].replace(experts_impl="loop")
    m, x = block(args), tokens()
    torch.testing.assert_close(m(x), naive(m, x), rtol=0, atol=1e-14)
    got, want = grads(m, x, m), grads(m, x, lambda t: naive(m, t))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-13, msg=k)


def reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s 2-D x 3-D semantics in any dtype: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]``."""
    starts = [0] + offs[:-1].tolist()
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


def test_the_padded_grouped_layout_equals_the_loop_in_float64():
    """The grouped path's permutation and zero padding, run through a float64 grouped matmul with torch's
    semantics (torch._grouped_mm has no float64 kernel): equal to the loop, forward and gradients, with empty
    groups."""
    g = torch.Generator().manual_seed(0)
    e, dim, hidden = 5, 8, 12
    counts = torch.tensor([3, 0, 7, 1, 0])
    x = torch.randn(int(counts.sum()), dim, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(e, *s, generator=g, dtype=torch.float64, requires_grad=True) for s in
          ((hidden, dim), (dim, hidden), (hidden, dim))]  # fmt: skip
    loop = moe._loop_swiglu(x, counts, *ws)
    grouped = moe._grouped_swiglu(x, counts, *ws, mm=reference_grouped_mm)
    torch.testing.assert_close(grouped, loop, rtol=1e-14, atol=0)  # outputs of size ~30: a few ulps
    d_loop = torch.autograd.grad(loop.sum(), [x, *ws])
    d_grouped = torch.autograd.grad(grouped.sum(), [x, *ws])
    for a, b in zip(d_grouped, d_loop):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_pad_groups_aligns_every_group_and_leaves_no_row_unassigned():
    counts = torch.tensor([3, 0, 9, 1])
    x = torch.arange(13, dtype=torch.float32)[:, None].repeat(1, 4) + 1
    padded, rows, offs = pad_groups(x, counts, align=4)
    assert offs.dtype == torch.int32
    assert offs.tolist() == [4, 4, 16, padded.shape[0]]  # group ends; the slack joins the last group
    assert padded.shape[0] % 4 == 0 and padded.shape[0] >= 13 + 4 * 3
    assert torch.equal(padded[rows], x)  # every row where ``rows`` says
    assert (padded.abs().sum(1) > 0).sum() == 13  # and every other row zero


def test_grouped_mm_runs_on_cpu_in_float32_and_matches_the_loop():
    args = CONFIGS["sigmoid bias groups (deepseek)"]
    ref = block(args)
    m32 = {impl: MoE(args.replace(experts_impl=impl)) for impl in ("grouped", "loop")}
    for m in m32.values():
        m.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x = tokens()
    out = {impl: m(x.float()) for impl, m in m32.items()}
    torch.testing.assert_close(out["grouped"], out["loop"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["grouped"].double(), naive(ref, x), rtol=1e-4, atol=1e-5)
    g = {impl: grads(m, x.float(), m) for impl, m in m32.items()}
    for k in g["loop"]:
        torch.testing.assert_close(g["grouped"][k], g["loop"][k], rtol=1e-4, atol=1e-5, msg=k)


def test_grouped_refuses_what_torch_grouped_mm_cannot_run_and_auto_falls_back():
    m = block(BASE.replace(experts_impl="grouped"))
    with pytest.raises(ValueError, match="torch._grouped_mm has no torch.float64 kernel"):
        m(tokens())
    m = MoE(BASE.replace(dim=6, experts_impl="grouped"))
    with pytest.raises(ValueError, match="dim 6 and hidden_dim 32 must be multiples of 4 in torch.float32"):
        m(torch.randn(1, 4, 6))
    auto = MoE(BASE)
    assert auto.experts.resolved_impl(torch.zeros(1, 16)) == "loop"  # CPU: the loop (docs/moe.md: measured)
    assert auto.experts.resolved_impl(torch.zeros(1, 16, dtype=torch.float64)) == "loop"


def test_dropless_every_token_reaches_its_experts_however_skewed():
    """A bias that sends every token to experts 0 and 1: nothing is dropped, the rest get empty groups and zero
    (not missing) gradients."""
    args = BASE.replace(score_func="sigmoid", load_balance_coeff=1e-3, experts_impl="loop")
    m, x = block(args), tokens()
    m.expert_bias.copy_(torch.tensor([2.0, 2.0] + [0.0] * 6))
    torch.testing.assert_close(m(x), naive(m, x), rtol=0, atol=1e-14)
    assert m.last_load.tolist() == [30, 30, 0, 0, 0, 0, 0, 0]
    g = grads(m, x, m)
    assert g["experts.w1"][2:].abs().max() == 0 and g["experts.w1"][:2].abs().max() > 0


# ------------------------------------------------------------------------------------------ balancing, statistics
def test_loads_are_counted_in_training_forwards_only_and_once_under_recomputation():
    m, x = block(BASE), tokens()
    m(x)
    first = m.last_load.clone()
    assert first.sum() == 30 * 2
    m(x.flip(0))
    assert torch.equal(expert_loads(m)[0], first + m.last_load)
    m.eval()
    with torch.no_grad():
        m(x)
    m.train()
    before = expert_loads(m).clone()
    checkpoint(m, x.requires_grad_(), use_reentrant=False).sum().backward()  # recomputed inside the backward
    assert torch.equal(expert_loads(m), before + m.last_load)
    reset_moe_stats(m)
    assert expert_loads(m).sum() == 0


def test_the_bias_update_pushes_overloaded_experts_down_and_stays_centred():
    bias = torch.zeros(4, dtype=torch.float64)
    new = expert_bias_update(bias, torch.tensor([10, 2, 2, 2]), coeff=0.1)  # mean 4
    assert new.tolist() == pytest.approx([-0.15, 0.05, 0.05, 0.05])
    assert abs(new.sum().item()) < 1e-15
    m = block(BASE.replace(load_balance_coeff=0.1))
    m.expert_bias.zero_()
    update_expert_biases(m, torch.tensor([[5, 1, 1, 1, 1, 1, 1, 5]]))
    assert m.expert_bias[0] < 0 and m.expert_bias[1] > 0
    with pytest.raises(ValueError, match="loads of shape"):
        update_expert_biases(m, torch.zeros(2, 8))


def aux_by_the_formula(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 sequence by sequence: alpha sum_i f_i P_i, averaged over the sequences."""
    a = m.args
    total = 0.0
    for seq in x:
        scores, idx, _ = m.router(seq, m.expert_bias)
        normed = scores / scores.sum(-1, keepdim=True)
        t = seq.shape[0]
        f = torch.stack([(idx == i).sum() for i in range(a.num_experts)]).double() * a.num_experts / (a.top_k * t)
        total = total + a.aux_loss_coeff * (f * normed.mean(0)).sum()
    return total / x.shape[0]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_is_deepseeks_sequence_wise_balance_loss(score_func):
    m, x = block(BASE.replace(score_func=score_func, aux_loss_coeff=0.01)), tokens()
    set_aux_loss_denominator(m, x.shape[0])
    m(x)
    torch.testing.assert_close(aux_losses(m)[0], aux_by_the_formula(m, x), rtol=0, atol=1e-17)


def test_aux_loss_enters_the_gradient_not_the_output():
    m, x = block(BASE.replace(aux_loss_coeff=0.5)), tokens()
    set_aux_loss_denominator(m, x.shape[0])
    off = block(BASE)  # the same weights without the aux loss
    torch.testing.assert_close(m(x), off(x), rtol=0, atol=0)
    got = grads(m, x, m)
    m.zero_grad()
    (aux_by_the_formula(m, x) + 0).backward()
    aux_grad = m.router.gate.weight.grad.clone()
    torch.testing.assert_close(got["router.gate.weight"], grads(off, x, off)["router.gate.weight"] + aux_grad)


def test_aux_loss_refuses_a_missing_global_denominator():
    m = block(BASE.replace(aux_loss_coeff=0.01))
    with pytest.raises(ValueError, match="set_aux_loss_denominator"):
        m(tokens())
    m.eval()
    m(tokens())  # no aux loss outside training


def contribution(m: MoE, x: torch.Tensor, sequences: int, counts_reduce=None):
    """(value, gradient of the router) of this piece's aux contribution."""
    reset_moe_stats(m)
    m.zero_grad()
    set_aux_loss_denominator(m, sequences)
    m.aux_counts_reduce = counts_reduce
    scores, idx, _ = m.router(x.reshape(-1, x.shape[-1]), m.expert_bias)
    aux = m.sequence_aux_loss(scores, idx, x.shape[0])
    aux.backward()
    return aux.detach(), m.router.gate.weight.grad.clone()


def test_aux_loss_contributions_add_up_over_batch_and_sequence_splits():
    """The derivation in titanlike/models/moe.py: with the global number of sequences and (for pieces of
    sequences) the whole sequences' counts, the pieces' contributions sum to the single-device value and gradient."""
    m, x = block(BASE.replace(score_func="sigmoid", aux_loss_coeff=0.01)), tokens(n_seq=4, seq=12)
    full, g_full = contribution(m, x, 4)
    halves = [contribution(m, part, 4) for part in x.chunk(2, dim=0)]  # data parallel: whole sequences
    torch.testing.assert_close(sum(v for v, _ in halves), full, rtol=0, atol=1e-17)
    torch.testing.assert_close(sum(g for _, g in halves), g_full, rtol=0, atol=1e-17)

    def counts_of(piece):
        _, idx, _ = m.router(piece.reshape(-1, piece.shape[-1]), m.expert_bias)
        one_hot = F.one_hot(idx, m.args.num_experts).sum(1).to(torch.float64)
        return one_hot.view(piece.shape[0], -1, m.args.num_experts).sum(1)

    pieces = [x[:, :5], x[:, 5:9], x[:, 9:]]  # uneven pieces of every sequence (context parallelism)
    whole = sum(counts_of(p) for p in pieces)
    parts = [contribution(m, p, 4, counts_reduce=lambda c: whole) for p in pieces]
    torch.testing.assert_close(sum(v for v, _ in parts), full, rtol=0, atol=1e-17)
    torch.testing.assert_close(sum(g for _, g in parts), g_full, rtol=0, atol=1e-17)
    local = sum(contribution(m, p, 4)[0] for p in pieces)  # without the counts of the whole sequence: wrong
    assert abs(local - full) > 1e-4


# ------------------------------------------------------------------------------------------ init, sizes
def test_param_init_covers_every_parameter_and_generates_each_expert_alone():
    m = block(CONFIGS["softmax renormalised, scaled, shared"], seed=7)
    plan = plan_from_patterns(param_init_patterns(r"layers\.(\d+)\.moe\."))
    w2 = m.experts.w2
    init = plan("layers.1.moe.experts.w2")
    assert init.std == pytest.approx(0.02 / math.sqrt(4))  # depth-scaled by the layer index of the prefix
    experts_2_3 = [torch.tensor([2, 3])] + local_indices(w2)[1:]
    part = generate(init, 7, "layers.1.moe.experts.w2", w2.shape, experts_2_3, dtype=torch.float64)
    assert torch.equal(part, w2[2:4])  # what an expert-parallel rank holding experts 2 and 3 generates
    again = MoE(m.args).double()
    init_parameters(again, plan, 7, prefix="layers.1.moe.")
    for (n, p), q in zip(m.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n


def test_parameter_counts():
    args = CONFIGS["softmax renormalised, scaled, shared"]
    m = MoE(args)
    assert sum(p.numel() for p in m.parameters()) == args.num_params()
    per_expert = 3 * 16 * 32
    assert args.num_params() - args.active_params() == per_expert * (8 - 2)
