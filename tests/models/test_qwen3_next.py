"""Qwen3-Next and the linear-attention seam: the chunked gated delta rule equals the exact recurrent form (with
initial states and document resets) and transformers' own torch fallbacks; the state-affine run reproduces any
entering state; the whole model equals the installed transformers ``Qwen3NextForCausalLM`` (float32 tolerance:
transformers computes in float32); a packed sequence under block_causal equals its documents run one by one."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

from titanlike.hf import model_args_from_hf_config
from titanlike.models import get_spec
from titanlike.models.linear_attention import (
    GatedDeltaCore,
    chunk_gated_delta_rule,
    conv_taps,
    l2norm,
    recurrent_gated_delta_rule,
    state_affine,
)
from titanlike.models.qwen3_next import hf as adapter

F64 = 1e-12
TOL = 1e-5  # float32
CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    full_attention_interval=2,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
    max_position_embeddings=128,
)


def _inputs(b=2, s=23, hk=2, hv=4, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(r(b, s, hk, dk)), l2norm(r(b, s, hk, dk))
    v = r(b, s, hv, dv)
    decay = -torch.rand(b, s, hv, generator=g, dtype=torch.float64)
    beta = torch.rand(b, s, hv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta


STARTS = torch.tensor([[0] * 5 + [5] * 9 + [14] * 9, [0] * 23])


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_equals_recurrent_with_state_and_documents(chunk):
    q, k, v, g, beta = _inputs()
    s0 = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    pos = torch.arange(23) + 7  # a piece further into the window: the starts are global positions
    for extra in ({}, {"starts": STARTS + 7, "positions": pos}):
        o1, f1 = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=s0, **extra)
        o2, f2 = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, **extra)
        assert (o1 - o2).abs().max() < F64 and (f1 - f2).abs().max() < F64


def test_equals_transformers_torch_fallbacks():
    q, k, v, g, beta = _inputs()
    s0 = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    ours, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    for fn, kw in (
        (hf_mod.torch_chunk_gated_delta_rule, {"chunk_size": 4}),
        (hf_mod.torch_recurrent_gated_delta_rule, {}),
    ):
        theirs, _ = fn(*(t.float() for t in (q, k, v, g, beta)), initial_state=s0.float(), **kw)
        assert (theirs.double() - ours).abs().max() < TOL


def test_documents_reset_the_state_as_if_run_alone():
    q, k, v, g, beta = _inputs()
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, starts=STARTS, positions=torch.arange(23))
    for lo, hi in ((0, 5), (5, 14), (14, 23)):
        alone, _ = recurrent_gated_delta_rule(*(t[:1, lo:hi] for t in (q, k, v, g, beta)))
        assert (alone - packed[:1, lo:hi]).abs().max() < F64


def test_state_affine_reproduces_any_entering_state():
    q, k, v, g, beta = _inputs()
    s0 = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    for extra in ({}, {"starts": STARTS + 3, "positions": torch.arange(23) + 3}):
        out0, corr, b, m = state_affine(q, k, v, g, beta, chunk_size=4, **extra)
        want, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, **extra)
        assert (out0 + torch.einsum("bshk,bhkv->bshv", corr, s0) - want).abs().max() < F64
        assert (m @ s0 + b - final).abs().max() < F64


def test_conv_taps_equal_causal_conv1d_and_reset_at_documents():
    x, w = torch.randn(2, 23, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    theirs = hf_mod.causal_conv1d_fn(x.transpose(1, 2), w, None, activation=None).transpose(1, 2)
    assert ((conv_taps(x, 4) * w).sum(-1) - theirs).abs().max() < F64
    packed = (conv_taps(x, 4, STARTS, torch.arange(23)) * w).sum(-1)
    alone = (conv_taps(x[:1, 5:14], 4) * w).sum(-1)
    assert (packed[:1, 5:14] - alone).abs().max() < F64


def test_core_forms_agree_and_bad_form_refused():
    q, k, v, g, beta = _inputs()
    a = GatedDeltaCore(4)(q, k, v, g, beta)
    b = GatedDeltaCore(form="recurrent")(q, k, v, g, beta)
    assert (a - b).abs().max() < F64
    with pytest.raises(ValueError, match="form must be"):
        GatedDeltaCore(form="parallel")


def _theirs(seed=0, **changes):
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**CONFIG, **changes}))
    with torch.no_grad():  # non-trivial norms and a wide router (top-k not decided by rounding)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "mlp.gate." in n:
                p.normal_(0, 0.3)
    return model.float().eval()


def _ours(theirs, **changes):
    args = model_args_from_hf_config(theirs.config.to_dict()).replace(**changes)
    model = get_spec("qwen3_next").build(args)
    model.load_state_dict(adapter.from_hf(theirs.state_dict(), args), strict=False)
    model.init_buffers()
    return model.float().eval(), args


def test_logits_equal_transformers_and_export_round_trips():
    theirs = _theirs()
    ours, args = _ours(theirs, linear_chunk_size=4)
    assert [args.layer_type(i) for i in range(4)] == theirs.config.layer_types
    x = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max() < TOL
    exported = adapter.to_hf(ours.state_dict(), args)
    back = adapter.from_hf(exported, args)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items() if k in back)
    assert set(back) == set(ours.state_dict())


def test_block_causal_packed_equals_documents_alone():
    ours, _ = _ours(_theirs(seed=1), linear_chunk_size=4)
    ours.double()
    ours.init_buffers()
    x = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    starts = torch.tensor([[0] * 7 + [7] * 13])
    ours.reset_position_ids = True
    with torch.no_grad():
        packed = ours(x, document_starts=starts)
        ours.reset_position_ids = False
        for lo, hi in ((0, 7), (7, 20)):
            assert (ours(x[:, lo:hi]) - packed[:, lo:hi]).abs().max() < 1e-10


def test_shared_expert_gate_and_flavors():
    spec = get_spec("qwen3_next")
    assert set(spec.flavors) >= {"debugmodel", "tiny", "80B-A3B"}
    big = spec.flavors["80B-A3B"]
    assert big.n_full_layers == 12 and big.rotary_dim == 64  # 3 Gated DeltaNet per gated attention; 64 of 256
    assert 79e9 < big.num_params() < 82e9 and 2.8e9 < big.num_active_params() < 4e9
    small = spec.flavors["debugmodel"].replace(vocab_size=64)
    model = spec.build(small)
    assert {b.layer_id: hasattr(b, "attention") for b in model.layers.values()} == {
        0: False,
        1: True,
        2: False,
        3: True,
    }
    assert sum(p.numel() for p in model.parameters()) == small.num_params()
    assert model.layers["0"].moe.shared_gate is not None


def test_config_fields_refused_in_one_line():
    fields = _theirs().config.to_dict()
    fields["layer_types"] = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    fields["hidden_act"] = "gelu"
    fields["mlp_only_layers"] = [1]
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(fields)
    msg = str(e.value)
    assert "\n" not in msg and "layer_types" in msg and "hidden_act" in msg and "mlp_only_layers" in msg


def test_init_follows_transformers_rules():
    args = get_spec("qwen3_next").flavors["tiny"].replace(vocab_size=64)
    model = get_spec("qwen3_next").build(args)
    model.init_weights(seed=0)
    a_log = model.layers["0"].linear_attn.decay.A_log
    assert (a_log.exp() >= 0.01).all() and (a_log.exp() <= 16).all() and a_log.std() > 0  # log(uniform(0.01, 16))
    assert torch.equal(model.layers["0"].linear_attn.decay.dt_bias, torch.ones(4))
    assert torch.equal(model.layers["1"].attention.q_norm.weight, torch.zeros(16))  # zero-centred: 1 + w
    assert torch.equal(model.layers["0"].linear_attn.norm.weight, torch.ones(8))
    again = get_spec("qwen3_next").build(args)
    again.init_weights(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
