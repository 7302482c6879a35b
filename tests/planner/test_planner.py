"""The layout planner's analytic parts: validation, the rank map, message volumes, bubble, shapes, activations.

Runs in one process in a few seconds. The dry run is in test_planner_dryrun.py, the comparison with real gloo
runs (message counts and bytes, bytes held per rank) in test_planner_gloo.py.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import plan as plan_cli
import pytest
import torch

from titanlike.config import model_args_from_config, parse_config
from titanlike.errors import ConfigError
from titanlike.models import ModelArgs, Transformer
from titanlike.parallel import ParallelDims, rank_groups
from titanlike.planner import (
    block_activation_bytes,
    bubble,
    group_map,
    hardware_for,
    make_plan,
    messages,
    render_plan,
    suggest_layouts,
)
from titanlike.planner.layout import Layout
from titanlike.planner.memory import inflight_microbatches, param_shapes

H100 = hardware_for("H100", gpus_per_node=8)


def _plan(world: int, *argv: str, hw=H100, vocab: int | None = None):
    cfg = parse_config(list(argv))
    args = model_args_from_config(cfg, vocab)
    return make_plan(cfg, world, hw, args, run_dry=False)


# The walkthrough's Lab 1: 16 GPUs, 8 per node, a 32-layer, 32-head model (Llama-3-8B with 32 kv heads).
LAB1 = (
    "--model.flavor",
    "8B",
    "--model.n_kv_heads",
    "32",
    "--training.seq_len",
    "4096",
    "--training.dtype",
    "bfloat16",
    "--training.local_batch_size",
    "8",
    "--parallelism.enable_sequence_parallel",
)


def test_lab1_tp8_pp2_is_legal_and_node_local():
    plan = _plan(16, *LAB1, "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "2")
    assert plan.legal and plan.warnings == [] or all("memory" in w for w in plan.warnings)
    lo = plan.layout
    assert (lo.tp, lo.pp, lo.dp) == (8, 2, 1)
    assert lo.groups["tp"].link == "nvlink" and not lo.groups["tp"].spanning
    assert lo.groups["tp"].example == tuple(range(8))
    assert lo.groups["pp"].link == "network" and lo.groups["pp"].example == (0, 8)  # pp crosses the two nodes
    text = render_plan(plan)
    assert "tp groups stay inside a node" in text and "span nodes" not in text
    assert plan.cost.dims["tp"].link == "nvlink" and plan.cost.dims["pp"].link == "network"


def test_lab1_tp16_is_legal_but_flagged_and_slow():
    good = _plan(16, *LAB1, "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "2")
    bad = _plan(16, *LAB1, "--parallelism.tensor_parallel_degree", "16")
    assert bad.legal  # every divisibility rule holds ...
    assert bad.layout.groups["tp"].spanning == (tuple(range(16)),)  # ... but the one tp group spans both nodes
    assert [w for w in bad.warnings if "tp groups span nodes" in w and "[0..15]" in w]
    assert "WARNING" in render_plan(bad) and "SPAN NODES" in render_plan(bad)
    assert bad.cost.dims["tp"].link == "network"

    # Part V's reason: the same per-layer all-reduce volume, now on a 9x slower wire, for twice the layers.
    def tp_seconds_per_block(plan):
        return plan.cost.dims["tp"].seconds / sum(n.startswith("layers.") for n in plan.layout.stages[0])

    assert tp_seconds_per_block(bad) > 8 * tp_seconds_per_block(good)
    assert bad.cost.step_time > good.cost.step_time


def test_lab1_suggest_ranks_node_local_tp_first_and_marks_the_rest():
    plan = _plan(16, *LAB1)
    found, stats = suggest_layouts(plan.cfg, 16, H100, plan.args, global_batch=8)
    assert found and stats["layouts"] == len(found) + stats["illegal"] + stats["out of memory"]
    assert not found[0].tp_spans_nodes and found[0].tp <= 8
    crossing = [c for c in found if c.tp_spans_nodes]
    assert crossing and all(c.tp == 16 for c in crossing)
    assert all(c.step_time > found[0].step_time for c in crossing)
    text = plan_cli.render_suggestions(plan, top=len(found))
    assert "TP ACROSS NODES" in text


def test_lab1_second_part_64_gpus_48_layers_64_heads():
    argv = (
        "--model.flavor",
        "70B",
        "--model.n_layers",
        "48",
        "--model.n_kv_heads",
        "64",
        "--training.seq_len",
        "4096",
        "--training.dtype",
        "bfloat16",
        "--training.local_batch_size",
        "8",
    )
    plan = _plan(64, *argv, "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "8")
    assert plan.legal and not plan.layout.groups["tp"].spanning and plan.layout.groups["pp"].crosses_nodes
    found, _ = suggest_layouts(plan.cfg, 64, H100, plan.args, global_batch=8)
    assert found[0].tp <= 8 and not found[0].tp_spans_nodes


def test_every_violation_at_once_each_with_its_fix():
    plan = _plan(
        12,
        "--parallelism.tensor_parallel_degree",
        "3",
        "--parallelism.enable_sequence_parallel",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--model.n_layers",
        "1",
        "--training.seq_len",
        "100",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "3",
        vocab=2006,
    )
    v = "\n".join(plan.violations)
    assert len(plan.violations) == 7 and plan.layout is None
    for needle in (
        "does not divide n_heads",
        "n_kv_heads 4",
        "the vocabulary 2048",
        "seq_len 100",
        "leave a stage empty",
        "fewer than pp",
        "global_batch_size 3",
    ):
        assert needle in v, needle
    text = render_plan(plan)
    assert f"{len(plan.violations)} violations" in text and all(x in text for x in plan.violations)


def test_cli_exit_codes_and_overrides():
    out = io.StringIO()
    with redirect_stdout(out):
        rc = plan_cli.main(["--world-size", "4", "--no-dry-run", "--parallelism.tensor_parallel_degree", "3"])
    assert rc == 2 and "does not divide n_heads" in out.getvalue()
    out = io.StringIO()
    with redirect_stdout(out):
        rc = plan_cli.main(
            [
                "--world-size",
                "8",
                "--gpus-per-node",
                "2",
                "--no-dry-run",
                "--ib-gbps",
                "25",
                "--parallelism.tensor_parallel_degree",
                "4",
                "--suggest",
                "--top",
                "3",
            ]
        )
    text = out.getvalue()
    assert rc == 0 and "network 25 GB/s" in text and "tp groups span nodes" in text and "== suggest" in text
    with pytest.raises(SystemExit):
        plan_cli.main(["--no-dry-run"])  # --world-size is required


def _layout(world, *argv, args=None):
    cfg = parse_config(list(argv))
    args = args or model_args_from_config(cfg)
    return Layout.from_config(cfg, world, args, 8), args


def _wire(msgs, dim, what=None):
    return sum(m.wire_bytes for m in msgs if m.dim == dim and (what is None or m.what.startswith(what)))


def test_tp_volume_is_megatrons_8_L_ring_bsh_with_and_without_sp():
    for sp in ((), ("--parallelism.enable_sequence_parallel",)):
        lo, args = _layout(
            8,
            "--model.flavor",
            "8B",
            "--training.seq_len",
            "2048",
            "--training.local_batch_size",
            "2",
            "--training.dtype",
            "bfloat16",
            "--parallelism.tensor_parallel_degree",
            "4",
            *sp,
        )
        b, s, h, t, L = 2, 2048, args.dim, 4, args.n_layers
        megatron = 8 * L * (t - 1) / t * b * s * h * 2
        msgs = messages(lo, args)
        assert _wire(msgs, "tp", "block") == pytest.approx(megatron, rel=1e-12)
        per_layer = sum(m.count for m in msgs if m.dim == "tp" and m.what.startswith("block")) / L
        assert per_layer == (8 if sp else 4)  # SP splits each all-reduce into an all-gather and a reduce-scatter


def test_pp_volume_is_2_m_bsh_times_v_and_dp_volume_is_2_ring_P():
    lo, args = _layout(
        16,
        "--model.flavor",
        "8B",
        "--training.seq_len",
        "2048",
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "4",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    )
    m, b, s, h, v = 8, 1, 2048, args.dim, 2
    middle = messages(lo, args, rank=lo.world_size // lo.pp)  # pp rank 1 holds stages 1 and 5: both send both ways
    assert _wire(middle, "pp") == 2 * m * v * b * s * h * 4
    # FSDP, fp32, nothing resharded: one all-gather and one reduce-scatter of every parameter: 2 (d-1)/d P.
    lo, args = _layout(8, "--model.flavor", "8B", "--parallelism.fsdp_reshard_after_forward", "never")
    d, P = 8, args.num_params()
    assert _wire(messages(lo, args), "dp_shard") == pytest.approx(2 * (d - 1) / d * P * 4, rel=1e-12)
    # bf16 mixed precision with resharding: bf16 gather twice (forward, backward) + fp32 reduce-scatter.
    lo, args = _layout(8, "--model.flavor", "8B", "--training.dtype", "bfloat16")
    head = args.vocab_size * args.dim + args.dim  # the head group is not resharded after its forward
    expect = (d - 1) / d * ((P - head) * (2 + 2 + 4) + head * (2 + 4))
    assert _wire(messages(lo, args), "dp_shard") == pytest.approx(expect, rel=1e-12)


def test_bubble_is_the_textbook_formula_for_1f1b_and_interleaved_and_less_for_zero_bubble():
    assert bubble("GPipe", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble("1F1B", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble("ZBVZeroBubble", 4, 8, 2) < 3 / 16
    assert bubble("1F1B", 1, 1, 1) == 0.0
    # In-flight microbatches: 1F1B keeps pp - rank, GPipe all of them.
    assert [c for (c,) in inflight_microbatches("1F1B", 4, 8, 1)] == [4, 3, 2, 1]
    assert inflight_microbatches("GPipe", 4, 8, 1)[0] == (8,)


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 4), (2, 1, 4, 1, 2), (2, 2, 2, 1, 2), (4, 1, 1, 1, 4)])
def test_group_map_matches_the_rank_grid(shape):
    pp, dpr, dps, cp, tp = shape
    dims = ParallelDims(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, world_size=pp * dpr * dps * cp * tp)
    for name in ("tp", "dp_shard", "dp_replicate", "dp", "pp"):
        groups = rank_groups(dims, name)
        gm = group_map(dims, name, gpus_per_node=4)
        assert gm.n_groups == len(groups) and gm.example == tuple(groups[0]) and gm.size == len(groups[0])
        crossing = {tuple(g) for g in groups if len({r // 4 for r in g}) > 1}
        assert set(gm.spanning) == (crossing if gm.size > 1 else set())


@pytest.mark.parametrize("tied", [False, True])
def test_param_shapes_match_the_model(tied):
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, tie_embeddings=tied)
    with torch.device("meta"):
        full = Transformer(args)
    for names, kept in (
        (["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"], None),
        (["layers.2", "norm", "output"], ("layers.2.", "norm.", "output.")),
        (["tok_embeddings", "layers.0"], ("tok_embeddings.", "layers.0.")),
    ):
        expected = {
            n: tuple(p.shape)
            for n, p in full.named_parameters(remove_duplicate=kept is None)
            if kept is None or n.startswith(kept)
        }
        assert param_shapes(args, names) == expected


def _measured_activations(args, layout_argv, mode):
    """Bytes a block holds after its forward on the CPU (MemTracker), excluding its output."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from titanlike.config import ActivationCheckpoint
    from titanlike.parallel.activation_checkpoint import apply_ac

    cfg = parse_config(list(layout_argv))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.training.dtype]
    from titanlike.parallel.pipeline import build_stage

    torch.manual_seed(0)
    stage = build_stage(Transformer(args), ["layers.0"])  # one block, as the planner's probe sees it
    stage.init_weights()
    for p in stage.parameters():
        p.data = p.data.to(dtype)
    if mode != "none":
        apply_ac(stage, ActivationCheckpoint(mode="full" if mode == "full" else "selective", selective_ac_option="op"))
    x_leaf = torch.randn(cfg.training.local_batch_size, cfg.training.seq_len, args.dim, dtype=dtype, requires_grad=True)
    kwargs = stage.block_kwargs(stage.positions(x_leaf))  # the RoPE rows: made once per forward for every block
    tracker = MemTracker()
    tracker.track_external(stage, x_leaf, *kwargs.values())
    with tracker:
        x = x_leaf * 1
        y = stage.layers["0"](x, **kwargs)
        del x
        snap = tracker.get_tracker_snapshot("current")
    held = sum(v for dev in snap.values() for k, v in dev.items() if str(k).endswith("ACT"))
    return held - y.numel() * y.element_size()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["none", "op", "full"])
def test_activation_formula_equals_what_a_real_block_holds(dtype, mode):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160, vocab_size=64, max_seq_len=64)
    argv = (
        "--training.dtype",
        dtype,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "3",
        "--model.flavor",
        "tiny",
    )
    lo, _ = _layout(1, *argv, args=args)
    assert block_activation_bytes(lo, args, 3 * 32, mode) == _measured_activations(args, argv, mode)


def test_block_causal_attention_fraction_scales_only_the_attention_flops(tmp_path):
    """The mask's cost model: the attention term of every block (the part linear in seq_len) times the corpus's
    kept share, nothing else; refused where it cannot hold; plan.py measures it on the config's corpus."""
    argv = ("--model.flavor", "8B", "--training.seq_len", "8192", "--training.dtype", "bfloat16")
    causal = _plan(8, *argv, vocab=128256)
    cfg = parse_config([*argv, "--model.attn_mask_type", "block_causal"])
    args = model_args_from_config(cfg, 128256)
    half = make_plan(cfg, 8, H100, args, run_dry=False, attention_fraction=0.5)
    attention = (args.flops_per_token(8192) - args.flops_per_token(0)) * causal.layout.tokens_per_step / 8
    assert causal.cost.rank_flops - half.cost.rank_flops == pytest.approx(attention / 2, rel=1e-9)
    assert "attention at 0.500 of causal" in render_plan(half)
    with pytest.raises(ConfigError, match="1 under model.attn_mask_type = causal"):
        make_plan(parse_config(list(argv)), 8, H100, args, run_dry=False, attention_fraction=0.5)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "a few words " * (i % 9 + 1)}) + "\n" for i in range(400)))
    out = io.StringIO()
    with redirect_stdout(out):
        rc = plan_cli.main(
            ["--world-size", "1", "--no-dry-run", "--model.attn_mask_type", "block_causal", "--data.path", str(docs)]
        )
    assert rc == 0 and "block_causal keeps" in out.getvalue() and "of causal)" in out.getvalue()
