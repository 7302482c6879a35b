"""The pipeline part of the equality gate (tests/parallel/pipeline_gate.py): one launch per world size (2, 4, 8),
every schedule / tied / 3-D layout within 1e-10 of one device in float64 (loss, grad norm, gradients, weights and
the validation loss), and every planted pipeline mutation caught where it should show."""

import gate
import pipeline_gate
import pytest
import shared_launch
from torch.distributed.pipelining import PipelineStage

TOL = pipeline_gate.TOL
# the mutations that change the forward (the loss of step 1) too: the MTP one through its depth's logged loss, which
# the gate compares with the loss
FORWARD_BREAKS = {"pp_starts_other_microbatch", "pp_mtp_tokens_other_microbatch", "pp_split_block_twice"}
BROKEN = gate.BROKEN  # a mutation must move its metric by at least this much (the tolerance is 1e-10)
# torch >= 2.15 backs up the stage's buffers before its metadata inference and restores them after: the MoE loads
# (buffers) are safe from it without titanlike's pause, so that mutation is no bug there and must train exactly
INFERENCE_RESTORES_BUFFERS = hasattr(PipelineStage, "_pre_metadata_inference_backup")
# Where each mutation must show. None but FORWARD_BREAKS changes the loss of step 1: they only break gradients (or
# the norm), which a loss-only test would miss.
EXPECTED_BREAK = {
    "pp_tied_not_summed": "weights",  # the copies of a tied parameter drift apart
    "pp_loss_over_microbatches": "grad_norm",  # gradients / m: the norm before clipping is off by m
    "pp_norm_not_reduced": "grad_norm",  # each stage reports (and clips by) its own norm
    "pp_tied_norm_twice": "grad_norm",  # the tied weight's gradient counted on both stages
    "pp_fsdp_reshard_after_forward": "grads",  # the trap the configuration refuses: weight grads lost
    "pp_starts_other_microbatch": "loss",  # each microbatch masked with another's documents
    "moe_local_loads": "biases",  # each stage's bias update from this rank's loads only
    "pp_moe_inference_counted": "biases",  # torch's shape-inference forward counted as routed tokens
    "pp_mtp_tokens_other_microbatch": "grads",  # DeepSeek-V3's MTP depths embed another microbatch's tokens
    "pp_split_block_twice": "loss",  # an uneven split off by one: a boundary block on two stages
}


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"world{n}")
def gate_results(request, tmp_path_factory):
    world = request.param
    results = shared_launch.results("pipeline", world, request, tmp_path_factory)  # one launch per world size
    print(f"\npipeline gate, world size {world} (max |diff| over 3 steps):")
    for name, r in results["layouts"].items():
        print(
            f"  {name:42s} loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} grads {r['grads']:.1e} "
            f"weights {r['weights']:.1e} eval {r['eval']:.1e}  {r['seconds']} s"
        )
    return world, results


def test_every_layout_of_the_world_size_ran(gate_results):
    world, results = gate_results
    expected = {layout.name for layout in pipeline_gate.LAYOUTS if layout.world_size == world}
    assert expected and set(results["layouts"]) == expected


def test_compiled_stages_capture_whole_blocks_and_stop_compiling(gate_results):
    """The compiled pipeline layouts (every stage's blocks compiled with fullgraph, aot_eager; every family under
    pp 2 x fsdp 2): no graph break, and nothing compiled after the second step on any rank (the stages' shape
    inference at the first step included)."""
    world, results = gate_results
    compiled = {n: r["compile"] for n, r in results["layouts"].items() if r["compile"]}
    names = [lo.name for lo in pipeline_gate.LAYOUTS if lo.world_size == world and "--compile.enable" in lo.args]
    assert sorted(compiled) == sorted(names)
    for name, c in compiled.items():
        graphs = c["graphs_after_step"]
        assert len(graphs) == gate.STEPS and graphs[0] >= 1 and graphs[-1] == graphs[1], (name, c)
        assert c["graph_breaks"] == 0, (name, c)


def test_pipelines_train_and_evaluate_exactly_like_one_device(gate_results):
    world, results = gate_results
    bad = {}
    for name, r in results["layouts"].items():
        if r["mutation"]:
            continue
        if not r["ok"]:
            bad[name] = {k: r[k] for k in ("loss", "grad_norm", "grads", "weights", "eval", "coverage")}
        assert min(r["ref_grad_norms"]) > 2 * r["max_norm"], name  # clipping acted on every step
    assert not bad, f"pipeline layouts differ from one device by more than {TOL}: {bad}"


def test_planted_pipeline_mutations_are_caught(gate_results):
    world, results = gate_results
    mutated = {name: r for name, r in results["layouts"].items() if r["mutation"]}
    assert mutated or world == 8
    for name, r in mutated.items():
        if r["mutation"] == "pp_moe_inference_counted" and INFERENCE_RESTORES_BUFFERS:
            assert r["ok"], f"{name}: torch restores the buffers its metadata inference touched"
            continue
        metric = EXPECTED_BREAK[r["mutation"]]
        assert not r["ok"], f"{name}: the gate passed a planted bug"
        assert r[metric] > BROKEN, f"{name}: expected {metric} to break, got {r[metric]:.1e}"
        if r["mutation"] not in FORWARD_BREAKS:
            assert r["loss_step1"] <= TOL, f"{name}: the first forward should still be exact"


def test_muon_stages_orthogonalize_each_matrix_once(gate_results):
    """pp 2 x fsdp 2 x tp 2: each stage's 4 ranks divide its blocks' matrices; over the 8 ranks every matrix of the
    model was orthogonalized exactly once per step."""
    world, results = gate_results
    for name, r in results["layouts"].items():
        if r["model"] == "muon_deep":
            counts = [s["matrices"] for s in r["muon_stats"]]
            assert sum(counts) == gate.MUON_MATRICES["muon_deep"] and max(counts) <= 7, (name, counts)
            assert all(s["comms"] == {"c10d.alltoall_base_": 2} for s in r["muon_stats"]), name  # CommDebugMode
    assert world != 8 or any(r["model"] == "muon_deep" for r in results["layouts"].values())
    problems = gate.planner_muon_mismatches(results, pipeline_gate.LAYOUTS, world)  # the planner's prediction
    assert problems[:-1] == [], problems


def test_every_mutation_and_schedule_is_exercised():
    layouts = pipeline_gate.LAYOUTS
    assert {l.mutation for l in layouts if l.mutation} == set(EXPECTED_BREAK)
    for degree in (2, 4):
        ran = {l.name.split()[-1] for l in layouts if l.name.startswith(f"pp{degree} ") and not l.mutation}
        assert set(pipeline_gate.SCHEDULES) <= ran, degree


def test_moe_stages_split_their_experts_over_ep(gate_results):
    """Qwen3-MoE stages: under ep every stage's experts are DTensors over the expert mesh (the 8-rank layout: FSDP
    over the 2 ranks holding the same experts too), without ep over none; the expert biases equal one device's."""
    world, results = gate_results
    moe = {n: r for n, r in results["layouts"].items() if r["model"] == "moe_deep" and not r["mutation"]}
    assert sorted(moe) == sorted(
        layout.name
        for layout in pipeline_gate.LAYOUTS
        if layout.world_size == world and layout.model == "moe_deep" and not layout.mutation
    )
    assert moe, world
    for name, r in moe.items():
        if "ep2" in name:
            assert r["expert_mesh"] == ["dp_shard_mod_ep", "ep"], (name, r["expert_mesh"])
        elif "fsdp2" in name:  # no ep: the experts FSDP-sharded like any weight
            assert r["expert_mesh"] == ["dp_shard"], (name, r["expert_mesh"])
        else:
            assert r["expert_mesh"] is None, (name, r["expert_mesh"])
        assert r["biases"] <= TOL, name


def test_uneven_layouts_split_unevenly():
    """The "uneven" layouts really split unevenly (torchtitan's split, titanlike.layout.stage_module_names), one with
    a stage holding the head alone."""
    from titanlike.config import model_args_from_config
    from titanlike.layout import stage_module_names

    splits = {}
    for layout in pipeline_gate.LAYOUTS:
        if "uneven" in layout.name and not layout.mutation:
            cfg = gate.config(layout, layout.world_size)
            stages = stage_module_names(cfg, model_args_from_config(cfg))
            splits[layout.name] = [sum(n.startswith("layers.") for n in s) for s in stages]
    assert splits == {
        "pp2 1F1B uneven 5 layers": [3, 2],
        "pp2 ZBVZeroBubble uneven 5 layers": [2, 1, 1, 1],
        "pp2 Interleaved1F1B uneven 5 layers 1+1": [1, 2, 2, 0],
        "pp2 fsdp2 InterleavedZeroBubble uneven 5 layers 1+1": [1, 2, 2, 0],
        "ds_block pp2 DualPipeV uneven head and MTP alone": [2, 1, 1, 0],
    }


def test_every_cp_method_runs_inside_pipeline_stages():
    """alltoall, ring and hybrid inside pp 2 stages for Llama (causal, tied), Llama block_causal, gpt-oss (window +
    sinks, block_causal) and DeepSeek-V3 (MLA) with 1F1B, and every method with a split-backward schedule."""
    names = {layout.name for layout in pipeline_gate.LAYOUTS}
    models = ("deep_tied", "block_deep", "gpt_oss_block_deep", "ds_deep_nomtp")
    for method, cp in (("a2a", "cp2"), ("ring", "cp2"), ("hybrid", "cp4_a2a2")):
        assert {f"{method} {m} {cp} pp2 1F1B" for m in models} <= names, method
    split = [s for s in pipeline_gate.SCHEDULES if s in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")]
    for method in ("allgather", "a2a", "ring", "hybrid"):
        assert any(n.startswith(f"{method} ") and n.split()[-1] in split for n in names), method
