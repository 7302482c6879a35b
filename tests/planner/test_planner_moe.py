"""The planner on mixture-of-experts models: expert memory per rank, the all-to-all bytes per layer, the load
imbalance it assumes, and a dry run whose shards equal the analytic ones (the exact comparison against real gloo
runs, messages and held bytes, is in test_planner_gloo.py)."""

from __future__ import annotations

import io
import warnings
from contextlib import redirect_stderr, redirect_stdout

import plan as plan_cli
import pytest
import torch

from titanlike.config import model_args_from_config, parse_config
from titanlike.errors import ConfigError
from titanlike.models.moe import MoE, MoEArgs, balanced_routing
from titanlike.planner import block_activation_bytes, dry_run, hardware_for, rank_param_shards
from titanlike.planner.cost import messages, step_cost
from titanlike.planner.layout import Layout
from titanlike.planner.memory import moe_layers

# (world size, ranks to check, overrides): every way the experts and the MoE blocks are sharded
LAYOUTS = {
    "ep8_fsdp16": (
        16,
        (0, 13),
        ["--model.flavor", "30B-A3B", "--parallelism.expert_parallel_degree", "8"],
    ),
    "hsdp2x4_ep4_op_ac": (
        8,
        (0, 7),
        [
            "--model.flavor",
            "30B-A3B",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "4",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ),
    # DeepSeek-shaped (the first 3 layers dense, a shared expert, 256 experts, group-limited routing): pp 2 puts the
    # dense layers alone on stage 0; ep 16 borrows tp 4 x dp_shard 4 (routers and shared experts over all 16)
    "deepseek_tp4_sp_ep16_pp2_full_ac": (
        64,
        (0, 63),
        [
            "--model.flavor",
            "deepseek",
            "--model.n_layers",
            "6",
            "--training.seq_len",
            "512",
            "--parallelism.tensor_parallel_degree",
            "4",
            "--parallelism.enable_sequence_parallel",
            "--parallelism.expert_parallel_degree",
            "16",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    "cp2_ep4_dim1": (
        32,
        (0, 5),
        [
            "--model.flavor",
            "30B-A3B",
            "--model.num_experts",
            "8",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "4",
        ],
    ),
}


def _config(extra):
    cfg = parse_config(
        ["--model.name", "qwen3_moe", "--model.n_layers", "4", "--training.seq_len", "1024", "--training.dtype"]
        + ["bfloat16", "--training.local_batch_size", "2", *extra]
    )
    return cfg, model_args_from_config(cfg, 100_288)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_dry_run_shards_and_probe_equal_the_analytic_ones(name):
    """titanlike's own parallelize_model on a fake process group: every parameter's local shape (routed experts
    Shard(0) over ep and FSDP over dp_shard_mod_ep on dim 0 or 1, routers and shared experts over dp_shard_cp_tp when
    ep borrows tp, dense layers as Qwen3's) equals the planner's, on the first and the last ranks; the activation
    probe (an MoE block routed round-robin under FakeTensorMode) equals the analytic bytes; the tensor-parallel plan
    of a model whose blocks differ (dense and MoE) raises no torch warning."""
    world, ranks, extra = LAYOUTS[name]
    cfg, args = _config(extra)
    layout = Layout.from_config(cfg, world, args, gpus_per_node=8)
    for rank in ranks:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not be resolved.*")
            d = dry_run(cfg, layout, args, rank=rank)
        analytic = {(s, p.name): p.local_shape for s, ps in rank_param_shards(layout, args, rank).items() for p in ps}
        assert {(r.stage, r.name): r.local_shape for r in d.params} == analytic, (name, rank)
        stage = layout.stages[layout.stage_ids(layout.pp_rank_of(rank))[0]]
        moe = moe_layers(args, stage).get(d.probe_layer)
        tokens = layout.microbatch_size * layout.local_seq_len
        mode = layout.checkpointed(d.probe_layer)
        expected = block_activation_bytes(layout, args, tokens, mode, moe, probe=True)
        assert d.block_activation_bytes == expected, (name, rank, d.probe_layer)
        experts = [r for r in d.params if ".experts.w" in r.name]
        if experts:  # placements as the docs say: (dp_shard_mod_ep, ep), ep innermost
            assert all(r.placements.endswith("'dp_shard_mod_ep', 'ep')") for r in experts), experts[0]
    if name == "cp2_ep4_dim1":  # 2 local experts over 4 ranks: FSDP splits each expert's rows (dim 1)
        assert experts[0].local_shape[0] == 2 and experts[0].local_shape[1] < experts[0].shape[1]
    if name == "deepseek_tp4_sp_ep16_pp2_full_ac":  # stage 0 holds the dense layers only: no expert there
        assert not [r for r in dry_run(cfg, layout, args, rank=0).params if ".moe." in r.name]


def test_all_to_all_bytes_per_layer_and_the_assumed_imbalance():
    """Per MoE layer and microbatch: 3 all-to-alls forward (counts, dispatch, combine), 2 backward; the dispatch
    sends (ep-1)/ep of the tokens x top_k rows of dim x 2 bytes, times the assumed imbalance, which also adds the
    busiest rank's extra expert FLOPs; an imbalance below 1 is refused."""
    cfg, args = _config(["--model.flavor", "30B-A3B", "--parallelism.expert_parallel_degree", "8"])
    hw = hardware_for("H100", gpus_per_node=8)

    def ep_messages(imbalance):
        layout = Layout.from_config(cfg, 16, args, 8, expert_imbalance=imbalance)
        return layout, [m for m in messages(layout, args) if m.dim == "ep"]

    layout, msgs = ep_messages(1.0)
    rows = 2 * 1024 * args.top_k * 7 // 8  # this rank's tokens x top-8, 7/8 of them off-rank
    dispatch = [m for m in msgs if "rows" in m.what or "grads" in m.what]
    counts = [m for m in msgs if "counts" in m.what]
    passes = layout.accum_steps
    assert sum(m.count for m in dispatch if m.phase == "forward") == 2 * 4 * passes  # 4 MoE layers
    assert sum(m.count for m in dispatch if m.phase == "backward") == 2 * 4 * passes
    assert sum(m.count for m in counts) == 4 * passes and all(m.nbytes == 128 * 8 * 7 / 8 for m in counts)
    assert {m.nbytes for m in dispatch} == {rows * args.dim * 2}
    _, skewed = ep_messages(1.5)
    assert {m.nbytes for m in skewed if "counts" not in m.what} == {round(rows * 1.5) * args.dim * 2}
    base = step_cost(layout, args, hw)
    busy = step_cost(Layout.from_config(cfg, 16, args, 8, expert_imbalance=1.5), args, hw)
    extra = 0.5 * 6 * 3 * args.dim * args.moe_hidden_dim * args.top_k * 4 * layout.tokens_per_step / 16
    assert busy.rank_flops == pytest.approx(base.rank_flops + extra)
    assert busy.dims["ep"].wire_bytes > base.dims["ep"].wire_bytes and busy.step_time > base.step_time
    with pytest.raises(ConfigError, match="expert imbalance 0.5"):
        Layout.from_config(cfg, 16, args, 8, expert_imbalance=0.5)


def test_padded_dispatch_moves_and_computes_every_experts_buffer():
    """parallelism.expert_dispatch padded: no counts exchange; each dispatch / combine sends (ep-1)/ep of experts x
    tokens rows (the imbalance does not matter: the buffers are the worst case), and every rank computes experts x
    tokens rows, experts - top_k more per token than the routed ones."""
    argv = ["--model.flavor", "30B-A3B", "--parallelism.expert_parallel_degree", "8"]
    cfg, args = _config(argv)
    padded_cfg, _ = _config([*argv, "--parallelism.expert_dispatch", "padded"])
    hw = hardware_for("H100", gpus_per_node=8)
    uneven = Layout.from_config(cfg, 16, args, 8)
    padded = Layout.from_config(padded_cfg, 16, args, 8, expert_imbalance=1.5)
    msgs = [m for m in messages(padded, args) if m.dim == "ep"]
    assert msgs and not [m for m in msgs if "counts" in m.what]
    assert {m.nbytes for m in msgs} == {2 * 1024 * args.num_experts * 7 // 8 * args.dim * 2}
    assert sum(m.count for m in msgs) == 4 * 4 * padded.accum_steps  # 2 forward + 2 backward, 4 MoE layers
    extra = 6 * 3 * args.dim * args.moe_hidden_dim * (args.num_experts - args.top_k) * 4 * uneven.tokens_per_step
    assert step_cost(padded, args, hw).rank_flops == pytest.approx(step_cost(uneven, args, hw).rank_flops + extra / 16)


def test_plan_text_shows_expert_memory_the_all_to_alls_and_the_ep_groups():
    argv = [
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "30B-A3B",
        "--model.n_layers",
        "4",
        "--world-size",
        "16",
        "--parallelism.expert_parallel_degree",
        "8",
        "--training.local_batch_size",  # 8 per rank (the default global batch, 8, does not split over dp 16)
        "8",
        "--expert-imbalance",
        "1.25",
    ]
    out = io.StringIO()
    with redirect_stdout(out):
        code = plan_cli.main(argv)
    text = out.getvalue()
    assert code in (0, 1), text
    assert "(ep 8 from dp_shard x cp, experts FSDP over the other 2)" in text
    assert "ep                   8       1       2" in text  # ep groups of 8, stride 1, 2 of them
    assert "dp_shard_mod_ep      2       8       8" in text
    assert "routed experts" in text and "16 of 128 experts per layer on this ep rank of 8" in text
    assert "busiest rank x1.25" in text and "assuming the busiest rank gets 1.25 x the mean load" in text
    assert "analytic shard shapes: all equal" in text and "without the ep dispatch" in text and "; equal" in text
    err = io.StringIO()
    with redirect_stderr(err):
        assert plan_cli.main(argv[:-1] + ["0.5"]) == 2
    assert "expert imbalance 0.5" in err.getvalue()
    # ep 16 over nodes of 8: every MoE layer's all-to-alls cross nodes, and the plan says so
    wide = ["--model.name", "qwen3_moe", "--model.flavor", "30B-A3B", "--model.n_layers", "4", "--world-size", "32"]
    wide += ["--training.local_batch_size", "8"]
    out = io.StringIO()
    with redirect_stdout(out):
        plan_cli.main(wide + ["--parallelism.expert_parallel_degree", "16", "--no-dry-run"])
    assert "WARNING: 2 of 2 ep groups span nodes: [0..15]; [16..31]; every layer's ep collectives" in out.getvalue()


def test_balanced_routing_gives_every_expert_the_same_rows_from_the_shapes():
    """The planner's balanced routing: round-robin expert ids (each token's top_k distinct), equal counts, the
    routing weights still the router's scores (it gets a gradient); tokens x top_k not divisible by the experts
    is refused."""
    torch.manual_seed(0)
    m = MoE(MoEArgs(dim=16, hidden_dim=8, num_experts=4, top_k=2, route_norm=True))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 6, 16)
    with balanced_routing():
        scores, idx, weights = m.router(x.view(-1, 16))
        y = m(x)
    assert idx.tolist()[:3] == [[0, 1], [2, 3], [0, 1]]
    assert m.last_load.tolist() == [6, 6, 6, 6]
    assert torch.allclose(weights, scores.gather(-1, idx) / scores.gather(-1, idx).sum(-1, keepdim=True))
    y.sum().backward()
    assert m.router.gate.weight.grad.abs().sum() > 0
    with balanced_routing(), pytest.raises(ValueError, match="do not divide over 4 experts"):
        m(torch.randn(1, 3, 16))
    _, idx, _ = m.router(x.view(-1, 16))  # outside the context: routed by the scores again
    assert idx.tolist() != [[0, 1], [2, 3]] * 6
