"""Expert parallelism (tests/parallel/moe_ep_worker.py, one launch per world size): every case equal to one device
in float64 (loss, gradients, weights, expert biases, aux loss), every planted mutation caught where it should be,
the all-to-alls pinned with CommDebugMode, and apply_ep's refusals."""

import contextlib

import moe_ep_worker as worker
import pytest
import shared_launch

BROKEN = 1e-6  # a mutation must move something by at least this much (the tolerance is 1e-10)

# Where each mutation must show, and whether step 1's loss stays exact (a gradient-only bug).
EXPECTED_BREAK = {
    "combine_unweighted": "grads_step1",  # the forward changes too, but the MoE output is small next to the residual
    "local_loads": "biases",  # step 1 is exact (the bias acts from step 2 on)
    "aux_per_rank": "grads_step1",  # the loss is the cross entropy: exact; the aux term's gradient is not
    "expert_fsdp_average": "grads_step1",
    "capacity_short": "grads_step1",  # the forward too: two tokens read one output row
    "padded_no_regroup": "grads_step1",  # rows computed by another rank's expert
}
STEP1_LOSS_EXACT = {"local_loads", "aux_per_rank", "expert_fsdp_average", "stale_splits"}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def results(request, tmp_path_factory):
    world = request.param
    data = shared_launch.results("ep", world, request, tmp_path_factory)  # in the session's launch of that size
    print(f"\nexpert parallelism, world size {world} (max |diff| over 3 steps):")
    for name, r in data["cases"].items():
        print(
            f"  {name:50s} loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} grads {r['grads']:.1e} "
            f"weights {r['weights']:.1e} biases {r['biases']:.1e} aux {r['aux']:.1e}  {r['seconds']} s"
        )
    return world, data


def test_every_case_of_the_world_size_ran(results):
    world, data = results
    assert set(data["cases"]) == {c.name for c in worker.CASES if c.world == world}


def test_expert_parallel_trains_exactly_like_one_device(results):
    _, data = results
    bad = {n: r for n, r in data["cases"].items() if not r["mutation"] and not r["ok"]}
    assert not bad, bad
    for name, r in data["cases"].items():
        if not r["mutation"]:
            assert r["init"] == 0.0, name  # each rank initialised only its shards, to the single-device values
            if "deepseek" in name:
                assert r["ref_aux"] > 0, name  # the aux loss was on
    assert any(r["bias_range"] > 0.05 for r in data["cases"].values())  # the bias update moved the biases


def test_every_mutation_breaks_where_it_should(results):
    _, data = results
    for name, r in data["cases"].items():
        m = r["mutation"]
        if not m:
            continue
        assert not r["ok"], name
        if m in STEP1_LOSS_EXACT:
            assert r["loss_step1"] <= worker.TOL, (name, r["loss_step1"])
        if m == "stale_splits":  # refused at the first forward whose routing differs from the cached one
            assert r["steps_done"] == 1, r
            assert "split sizes not from this forward's counts" in r["error"], r["error"]
            continue
        assert r["error"] == "", r["error"]
        assert r[EXPECTED_BREAK[m]] > BROKEN, (name, EXPECTED_BREAK[m], r)


def test_uneven_and_empty_splits_are_exercised(results):
    world, data = results
    cases = data["cases"]
    uneven = [r for r in cases.values() if r["dispatch"] == "uneven"]
    assert all(r["max_split"] > r["min_split"] for r in uneven)  # uneven everywhere
    assert all(r["max_split"] == -1 for r in cases.values() if r["dispatch"] == "padded")  # no split sizes at all
    if world == 2:
        assert cases["ep2 every token to rank 0's experts"]["min_split"] == 0  # rank 1's experts get nothing
    else:
        assert cases["ep2 x expert fsdp2, 6 experts (fsdp on dim 1)"]["expert_placements"] == ["S(1)", "S(0)"]
        assert cases["ep2 x expert fsdp2 (dp4)"]["expert_placements"][1] == "S(0)"


def test_one_moe_layer_is_three_all_to_alls_forward_and_two_backward(results):
    """Counts exchange + dispatch + combine forward; the two transposes backward; nothing else. Bytes: the counts
    (E int64), the rows sent (tokens x top_k x dim x 8) and the rows received; the backward moves the same rows."""
    world, data = results
    e, k, row = worker.DEEPSEEK.num_experts, worker.DEEPSEEK.top_k, worker.DIM * 8
    total_sent = 0
    for r in data["probes"]["comms_per_rank"]:
        sent, received = r["tokens"] * k, sum(r["recv"])
        assert sum(r["send"]) == sent
        assert r["forward"] == {"all_to_all_single": [3, e * 8 + (sent + received) * row]}
        assert r["backward"] == {"all_to_all_single": [2, (sent + received) * row]}
        assert r["counts"] == {"c10d_functional.all_to_all_single": 3}  # CommDebugMode's own count agrees
        assert r["experts_grad_is_shard"]
        total_sent += sent - received
    assert total_sent == 0  # every row sent is received once
    assert len({tuple(r["send"]) for r in data["probes"]["comms_per_rank"]}) > 1  # uneven splits


def test_padded_dispatch_reads_nothing_on_the_host_and_moves_fixed_buffers(results):
    """One MoE layer under ep with the padded dispatch, forward and backward, recorded (moe_ep_worker.HostReads): no
    scalar read, no tolist / item, no op with a data-dependent shape; the uneven dispatch under the same recorder
    reads its split sizes (the recorder records). Collectives: dispatch and combine forward, their transposes
    backward, each sending this rank's full (experts x capacity) buffer whatever the routing."""
    world, data = results
    probe = data["probes"]["padded"]
    assert probe["padded"]["host_reads"] == [], probe["padded"]
    assert "Tensor.tolist" in probe["uneven"]["host_reads"], probe["uneven"]
    capacity = (worker.BATCH // world) * worker.SEQ  # the rank's tokens (float64 aligns rows to 2: already even)
    buffer = worker.DEEPSEEK.num_experts * capacity * worker.DIM * 8
    assert probe["padded"]["comms"] == {"all_to_all_single": [4, 4 * buffer]}


def test_padded_dispatch_on_one_process_is_exact_and_reads_nothing_on_the_host():
    """ep 1: the padded buffers give the uneven dispatch's output and every gradient, with no host read forward or
    backward: float64 batched matmuls (the gpt-oss biased and clamped experts too), and float32 through
    ``torch._grouped_mm`` with the static group ends (bitwise: both paths multiply each row alike)."""
    import torch

    from titanlike.models.moe import MoE, set_expert_dispatch

    cases = [(worker.DEEPSEEK, torch.float64, "loop"), (worker.GPT_OSS, torch.float64, "loop")]
    cases.append((worker.QWEN, torch.float32, "grouped"))
    for args, dtype, impl in cases:
        torch.manual_seed(0)
        args = args.replace(aux_loss_coeff=0.0)
        blocks = {"uneven": MoE(args.replace(experts_impl="loop")), "padded": MoE(args.replace(experts_impl=impl))}
        for p in blocks["uneven"].parameters():
            torch.nn.init.normal_(p, std=0.3)
        blocks["padded"].load_state_dict(blocks["uneven"].state_dict())
        set_expert_dispatch(blocks["padded"], "padded")
        x = torch.randn(3, 10, worker.DIM, dtype=dtype)
        outs, grads = {}, {}
        for d, block in blocks.items():
            block.to(dtype)
            xd = x.clone().requires_grad_()
            with worker.HostReads() if d == "padded" else contextlib.nullcontext() as reads:
                outs[d] = block(xd)
                outs[d].pow(2).sum().backward()
            grads[d] = [xd.grad] + [p.grad for p in block.parameters()]
        assert reads.seen == [], (impl, reads.seen)
        assert blocks["padded"].experts.resolved_impl(x) == impl
        tol = worker.TOL if dtype == torch.float64 else 1e-6  # (float32: equal bitwise here; not promised)
        assert (outs["padded"] - outs["uneven"]).abs().max() <= tol, impl
        assert all((a - b).abs().max() <= tol for a, b in zip(grads["padded"], grads["uneven"])), impl


def test_apply_ep_refuses_what_it_cannot_do_in_one_line(results):
    _, data = results
    ref = data["probes"]["refusals"]
    assert "'layers.0.moe.experts' has" in ref["indivisible"] and "not divisible by ep" in ref["indivisible"]
    assert "'layers.1.moe.experts'" in ref["indivisible"]  # every offending module in the one message
    assert "has no GroupedExperts module" in ref["no experts"]
    assert "already sharded" in ref["twice"]


def test_regroup_order_lists_each_local_experts_rows_together():
    import torch

    from titanlike.parallel.expert_parallel import regroup_order

    # rows arrive as (rank 0: expert 0 x2, expert 1 x1), (rank 1: expert 0 x1, expert 1 x3)
    order = regroup_order(torch.tensor([[2, 1], [1, 3]]))
    assert order.tolist() == [0, 1, 3, 2, 4, 5, 6]
    assert regroup_order(torch.tensor([[0, 2], [0, 0]]), total=2).tolist() == [0, 1]  # empty blocks


def test_apply_expert_fsdp_refuses_a_model_without_experts():
    from torch import nn

    from titanlike.parallel.expert_parallel import apply_expert_fsdp

    with pytest.raises(ValueError, match="apply_expert_fsdp: Linear has no GroupedExperts module"):
        apply_expert_fsdp(nn.Linear(2, 2), mesh=None)


def test_padded_block_compiles_to_one_static_graph_and_the_uneven_one_has_data_dependent_sizes():
    """What torch.compile sees: the padded block (eval mode: the training-only load counter asks autograd whether it
    runs in a backward) traces forward + backward as one graph whose shapes are all static (``fullgraph=True``,
    ``dynamic=False``) and equals the eager block; the uneven one traces whole too, but only through unbacked symbolic
    sizes (its split sizes are data read on the host: a device sync on a GPU)."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from titanlike.models.moe import MoE, set_expert_dispatch

    unbacked = {}
    for dispatch in ("padded", "uneven"):
        torch._dynamo.reset()

        def backend(gm, example_inputs, dispatch=dispatch):
            vals = [n.meta["example_value"] for n in gm.graph.nodes if "example_value" in n.meta]
            unbacked[dispatch] = sorted(str(s) for v in vals for s in free_unbacked_symbols(v))
            return gm.forward

        torch.manual_seed(0)
        block = MoE(worker.QWEN.replace(aux_loss_coeff=0.0)).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        set_expert_dispatch(block, dispatch)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
            x = torch.randn(2, 8, worker.DIM, requires_grad=True)
            y = compiled(x)
            y.sum().backward()
        assert torch.equal(y, block(x)), dispatch
    torch._dynamo.reset()
    assert unbacked["padded"] == [], unbacked["padded"]
    assert unbacked["uneven"], "the uneven block's split sizes should be data-dependent"
