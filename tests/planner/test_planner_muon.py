"""The planner's Muon: owners, Newton-Schulz FLOPs and all-to-all bytes per rank at scale, its price line and
its optimizer memory. (Against the real optimizer's counts: every Muon layout of the float64 gate,
tests/parallel/test_parallel_gate.py and test_pipeline_gate.py.)"""

from __future__ import annotations

from titanlike.config import model_args_from_config, parse_config
from titanlike.layout.muon import ns_flops, plan_buckets
from titanlike.planner import hardware_for, make_plan, render_plan
from titanlike.planner.layout import Layout
from titanlike.planner.muon import muon_rank

H100 = hardware_for("H100", gpus_per_node=8)
LLAMA_8B = ("--job.config_file", "configs/llama3_8b.toml")


def test_buckets_hold_one_matrix_per_rank_at_least():
    """Every owner works in every bucket: a bucket closes once it holds a matrix per rank and the byte budget."""
    buckets = plan_buckets([10] * 10, 4, 0)
    assert [b.items for b in buckets] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [b.owners for b in buckets] == [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1)]
    assert len(plan_buckets([10] * 10, 2, 35)) == 3  # 4, 4, 2 matrices: 40 bytes each before closing
    assert ns_flops(2, 3, 1) == 4 * 4 * 3 + 2 * 8


def test_llama_8b_on_64_ranks_divides_the_matrices_and_counts_the_bytes():
    """fsdp 64 (bf16): the 224 block matrices are orthogonalized once, at most 4 per rank; each rank sends about
    what it receives (its 1/64 blocks out and back, its own matrices in full), in 2 all-to-alls per bucket; under
    tp 8 x fsdp 8 the same division holds over the 64 ranks of the mesh."""
    for world, extra in ((64, ()), (64, ("--parallelism.tensor_parallel_degree", "8"))):
        cfg = parse_config([*LLAMA_8B, "--optimizer.name", "Muon", *extra])
        args = model_args_from_config(cfg)
        lo = Layout.from_config(cfg, world, args, gpus_per_node=8)
        ranks = [muon_rank(lo, args, r) for r in range(world)]
        assert sum(r.matrices for r in ranks) == 7 * 32 and max(r.matrices for r in ranks) == 4
        total = sum(r.ns_flops for r in ranks)
        per_block = ns_flops(4096, 4096, 5) * 2 + ns_flops(1024, 4096, 5) * 2 + ns_flops(14336, 4096, 5) * 3
        assert total == 32 * per_block
        assert sum(r.sent for r in ranks) == sum(r.received for r in ranks)
        assert all(r.collectives == ranks[0].collectives > 0 and r.group == world for r in ranks)
    adamw = make_plan(parse_config(list(LLAMA_8B)), 64, H100, args, run_dry=False)
    muon = make_plan(parse_config([*LLAMA_8B, "--optimizer.name", "Muon"]), 64, H100, args, run_dry=False)
    item = {it.name: it for it in muon.memory[0]}["optimizer"]
    assert item.bytes < {it.name: it for it in adamw.memory[0]}["optimizer"].bytes
    assert "Muon momentum_buffer (224 matrix parameters)" in item.note
    assert muon.cost.optimizer > 0 and muon.cost.step_time > adamw.cost.step_time
    text = render_plan(muon)
    assert "optimizer: Muon orthogonalizes 4 matrices on this rank (of its group of 64)" in text
    assert "muon            all_to_all" in text


def test_a_local_stage_orthogonalizes_its_own_matrices_without_messages():
    """pp 2 without dp / tp: plain parameters, each stage's rank orthogonalizes all of its blocks' matrices."""
    cfg = parse_config(
        ["--model.flavor", "tiny", "--optimizer.name", "Muon", "--parallelism.pipeline_parallel_degree", "2"]
    )
    args = model_args_from_config(cfg, 128)
    lo = Layout.from_config(cfg, 2, args, gpus_per_node=8)
    first, last = muon_rank(lo, args, 0), muon_rank(lo, args, 1)
    assert first.matrices + last.matrices == 7 * args.n_layers and first.collectives == first.sent == 0
    assert first.group == 1
