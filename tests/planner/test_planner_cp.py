"""The planner's context-parallel methods side by side: the K/V a layer holds per rank, the messages per block, and
``--suggest`` choosing the method. The messages themselves are pinned against gloo runs (CommDebugMode's counts) in
test_planner_gloo.py, the activation terms against the dry run's probe in test_planner_dryrun.py."""

from __future__ import annotations

import plan as plan_cli

from titanlike.config import model_args_from_config, parse_config
from titanlike.planner import hardware_for, make_plan, messages, render_plan, suggest_layouts
from titanlike.planner.memory import cp_head_widths, cp_kv_bytes

H100 = hardware_for("H100", gpus_per_node=8)


def _plan(world: int, method: str, *argv: str):
    cfg = parse_config(
        [
            "--job.config_file",
            "configs/llama3_8b.toml",
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "-1",
            "--parallelism.context_parallel_method",
            method,
            *argv,
        ]
    )
    return make_plan(cfg, world, H100, model_args_from_config(cfg, 128256), run_dry=False)


LONG = ("--training.seq_len", "131072", "--model.max_seq_len", "131072", "--parallelism.context_parallel_degree", "8")


def test_all_to_all_holds_one_cpth_of_the_keys_and_values_and_moves_q_k_v_and_the_output():
    ag, a2a = _plan(64, "allgather", *LONG), _plan(64, "alltoall", *LONG)
    assert ag.legal and a2a.legal
    # Llama 3 8B, one 128k sequence: 32 heads x 128 of K and of V, bf16, whole sequence: 2 GiB; / cp 8
    assert cp_kv_bytes(ag.layout, ag.args) == 2 * 131072 * 32 * 128 * 2 == 8 * cp_kv_bytes(a2a.layout, a2a.args)
    assert cp_head_widths(a2a.layout, a2a.args) == {"q": 4096, "k": 1024, "v": 1024, "out": 4096}
    by = {m.what: m for m in messages(a2a.layout, a2a.args) if m.dim == "cp"}
    local = 131072 // 8 * 2  # bytes per number of this rank's tokens
    assert by["q heads of every block"].nbytes == local * 4096 * 7 // 8 and by["q heads of every block"].count == 32
    assert by["k heads of every block"].nbytes == local * 1024 * 7 // 8
    assert {m.op for m in messages(a2a.layout, a2a.args) if m.dim == "cp"} == {"all_to_all"}
    # the all-to-all's bytes (q and out are h wide, k and v kv_dim) against the all-gather's 4 x (cp-1)/cp K or V
    ag_wire = sum(m.wire_bytes for m in messages(ag.layout, ag.args) if m.dim == "cp")
    a2a_wire = sum(m.wire_bytes for m in messages(a2a.layout, a2a.args) if m.dim == "cp")
    assert a2a_wire / ag_wire == (2 * (2 * 4096 + 2 * 1024) * local) / (4 * 131072 * 1024 * 2) == 0.625
    text = render_plan(a2a)
    assert "cp (all-to-all over heads): per block 4 all-to-alls forward" in text and "all-gather: 2.00 GiB" in text


def test_suggest_tries_every_cp_method_and_ranks_them():
    plan = _plan(64, "allgather", *LONG)
    found, stats = suggest_layouts(plan.cfg, 64, H100, plan.args, global_batch=8)
    assert found and all(c.cp == 8 for c in found)
    hybrid = {"hybrid a2a 2", "hybrid a2a 4"}  # all-to-all groups of 2 or 4, a ring across 4 or 2 of them
    assert {c.cp_method for c in found} == {"allgather", "alltoall", "ring", *hybrid}
    assert [c.step_time for c in found] == sorted(c.step_time for c in found)
    # the same layout both ways: the all-to-all holds less without AC (its K / V are 1 / cp of the whole
    # sequence's), the same under full AC (the block input only)
    pairs = {}
    for c in found:
        key = (c.tp, c.pp, c.dp_shard, c.schedule, c.stages_per_rank, c.microbatch, c.ac)
        pairs.setdefault(key, {})[c.cp_method] = c
    both = [p for p in pairs.values() if {"allgather", "alltoall"} <= set(p)]
    assert all(p["alltoall"].memory < p["allgather"].memory for p in both if p["alltoall"].ac == "none")
    assert any(p["alltoall"].ac == "none" for p in both)
    a2a = next(c for c in found if c.cp_method == "alltoall")
    assert "--parallelism.context_parallel_method alltoall" in " ".join(a2a.overrides)
    text = plan_cli.render_suggestions(plan, top=len(found))
    assert "cp 8 alltoall" in text and "cp 8 allgather" in text and "cp 8 hybrid a2a 4" in text
    h2 = next(c for c in found if c.cp_method == "hybrid a2a 2")
    assert "--parallelism.context_parallel_a2a_degree 2" in " ".join(h2.overrides)
    # a head count cp cannot split: the all-to-all is illegal (rule cp_heads), the all-gather, the ring and the
    # hybrid's groups of 2 and 4 (which divide the 36 heads) are ranked
    odd = _plan(64, "allgather", *LONG, "--model.n_heads", "36", "--model.n_kv_heads", "4", "--model.dim", "4608")
    found, _ = suggest_layouts(odd.cfg, 64, H100, odd.args, global_batch=8)
    assert found and {c.cp_method for c in found} == {"allgather", "ring", *hybrid}


def test_all_to_all_and_ring_block_activations_equal_the_dry_run_probe():
    """One Qwen3 0.6B block (16 heads, 8 kv heads, q/k norms) at tp 2 x cp 4 under the all-to-all, the ring and the
    hybrid (a2a 2 x ring 2) cores, as the dry run's FakeTensorMode probe measures it: no gathered K / V without AC
    (the all-to-all kernel holds the whole sequence of heads / cp heads: the size of the local tokens of every head;
    the ring its own chunks' q, k, v; the hybrid both), under op AC the four all-to-alls' outputs, or the ring's
    block scores and outputs (the hybrid both)."""
    from titanlike.planner.dryrun import dry_run
    from titanlike.planner.layout import Layout
    from titanlike.planner.memory import block_activation_bytes

    for method, ac, mode in [
        (m, ac, mode) for m in ("alltoall", "ring", "hybrid") for ac, mode in (("none", "none"), ("selective", "op"))
    ]:
        a2a = ("--parallelism.context_parallel_a2a_degree", "2") if method == "hybrid" else ()
        cfg = parse_config(
            [
                *("--model.name", "qwen3", "--model.flavor", "0.6B", "--training.seq_len", "512"),
                *("--training.dtype", "bfloat16", "--training.local_batch_size", "1"),
                *("--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "4"),
                *("--parallelism.context_parallel_method", method, "--activation_checkpoint.mode", ac),
                *a2a,
            ]
        )
        args = model_args_from_config(cfg)
        layout = Layout.from_config(cfg, 16, args, gpus_per_node=8)
        d = dry_run(cfg, layout, args, rank=0)
        assert layout.checkpointed(d.probe_layer) == mode
        tokens = layout.microbatch_size * layout.local_seq_len
        assert d.block_activation_bytes == block_activation_bytes(layout, args, tokens, mode), (method, ac)


def test_ring_sends_k_and_v_blocks_and_hides_them_under_the_attention():
    ring, ag = _plan(64, "ring", *LONG), _plan(64, "allgather", *LONG)
    sends = [m for m in messages(ring.layout, ring.args) if m.dim == "cp"]
    assert {m.op for m in sends} == {"send"}
    k = 131072 // 8 * 8 * 128 * 2  # this rank's K: 16k tokens of 8 kv heads x 128, bf16
    fwd = sum(m.count for m in sends if m.phase == "forward" and m.nbytes == k)
    assert fwd == 2 * 7 * 32  # K and V, cp - 1 hops, 32 blocks
    # K/V held: one visiting pair of every head (1/cp of the all-gather's) and the next pair arriving (kv heads)
    assert cp_kv_bytes(ring.layout, ring.args) == cp_kv_bytes(ag.layout, ag.args) // 8 + 2 * k
    d = ring.cost.dims["cp"]
    assert d.exposed < d.seconds  # the transfers overlap the attention compute
    assert "cp (ring): per block this rank's K and V" in render_plan(ring)


def _config_plan(config: str, world: int, vocab: int, *argv: str):
    cfg = parse_config(["--job.config_file", config, "--training.global_batch_size", "-1", *argv])
    return make_plan(cfg, world, H100, model_args_from_config(cfg, vocab), run_dry=False)


def test_ring_steps_a_window_needs_and_the_planner_prices_them():
    """The ring's static steps: every one for causal full attention; a window within a chunk only the neighbours'
    (steps 1 and cp - 1), under the ring's layout and hybrid's groups alike. gpt-oss-120b at 32k, cp 8 (chunks of
    2048, window 128): its windowed layers send K / V 2 times per pass where the full ones send them 7 times."""
    from titanlike.parallel.context_parallel import chunk_ids, hybrid_layout
    from titanlike.parallel.ring_attention import ring_steps

    assert ring_steps(8, chunk_ids, 2048, None) == tuple(range(8))
    assert ring_steps(8, chunk_ids, 2048, 128) == ring_steps(8, chunk_ids, 2048, 2048) == (0, 1, 7)
    assert ring_steps(8, chunk_ids, 2048, 4096) == (0, 1, 2, 6, 7)  # a window of two chunks
    assert ring_steps(4, hybrid_layout(2), 2048, 128) == (0, 1, 3)  # cp 8 = a2a 2 x ring 4
    argv = ("--training.seq_len", "32768", "--model.max_seq_len", "32768", "--parallelism.context_parallel_degree")
    plan = _config_plan(
        "configs/gpt_oss_120b.toml", 128, 201088, *argv, "8", "--parallelism.context_parallel_method", "ring"
    )
    assert plan.legal and plan.args.window_of(0) == 128 and plan.args.window_of(1) is None
    fwd = [m for m in messages(plan.layout, plan.args) if m.dim == "cp" and m.phase == "forward"]
    k = 4 * 32768 // 8 * 8 * 64 * 2  # the microbatch of 4 of this rank's 4096 tokens, 8 kv heads of 64, bf16
    assert plan.layout.microbatch_size == 4 and plan.layout.accum_steps == 1
    assert {m.nbytes for m in fwd} == {k} and sum(m.count for m in fwd) == 2 * (18 * 2 + 18 * 7)  # K and V
    assert "(7 or 2 of 7: a sliding window within a chunk needs 2)" in render_plan(plan)


def test_ring_moves_mlas_latent_not_the_expanded_heads():
    """DeepSeek-V3 under the ring: the latent (512) and the shared RoPE key (64) per token travel, not 128 heads'
    keys (192) and values (128); the K/V a layer holds is one visiting block of every head plus the arriving latent."""
    argv = ("--training.seq_len", "32768", "--model.max_seq_len", "32768", "--parallelism.context_parallel_degree")
    schedule = ("--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.context_parallel_method", "ring")
    plan = _config_plan("configs/deepseek_v3_671b.toml", 1024, 129280, *argv, "4", *schedule)
    assert plan.legal
    sends = [m for m in messages(plan.layout, plan.args) if m.dim == "cp"]
    local = 32768 // 4 * 2  # bytes per number of this rank's 8192 tokens (microbatch 1, bf16)
    assert {m.op for m in sends} == {"send"} and {m.nbytes for m in sends} == {local * 512, local * 64}
    whole = 32768 * 128 * (192 + 128) * 2
    assert cp_kv_bytes(plan.layout, plan.args) == whole // 4 + local * 576
    assert "cp (ring): per block this rank's MLA latent and MLA shared RoPE key" in render_plan(plan)
