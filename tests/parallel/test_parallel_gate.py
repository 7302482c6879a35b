"""The equality gate (tests/parallel/gate.py): one launch per world size, every layout <= 1e-10 of one device in
float64, and every planted mutation caught where it should be."""

import gate
import pytest
import shared_launch

# Where each mutation must show. "forward" mutations change the loss of step 1; the others leave the forward
# (and so the loss of step 1) exactly right and only break gradients: a forward-only test would pass them.
EXPECTED_BREAK = {
    "to_empty_drops_grad_hooks": ("grad_placements", False),
    "init_ignores_shards": ("init", True),
    "init_strided_as_shard": ("init", True),
    "tp_no_backward_reduce": ("grads", False),
    "ce_no_max_all_reduce": ("loss_step1", True),
    "sp_norm_plain": ("grads", False),
    "qk_norm_replicated": ("grads", False),
    "loss_mean_per_rank": ("loss_step1", True),
    "fsdp_average": ("grad_norm", False),
    "fused_plain_colwise": ("loss_step1", True),
    # offload: a stale saved tensor breaks only the backward; a stale device copy of the host shards, step 2 on
    "act_offload_stale": ("grads", False),
    "zero1_not_all_gathered": ("weights", False),
    "cpu_offload_stale_device_copy": ("eval", False),
    "eval_keeps_unsharded": ("grad_norm", False),
    "cp_kv_grad_not_reduced": ("grads", False),
    "cp_chunks_wrong_order": ("loss_step1", True),
    "cp_rope_local": ("loss_step1", True),
    "cp_tokens_per_rank": ("loss_step1", True),
    # all-to-all over heads (Ulysses): head groups joined in the wrong order, the reverse exchange skipped in the
    # backward, the sinks of another rank's heads
    "a2a_heads_order": ("loss_step1", True),
    "a2a_no_grad": ("grads", False),
    "a2a_sinks_heads": ("loss_step1", True),
    # ring attention: a step skipped, the log-sum-exps merged by max, dK / dV kept where computed, the sinks dropped
    "ring_step_skipped": ("loss_step1", True),
    "ring_merge_max": ("loss_step1", True),
    "ring_grads_kept": ("grads", False),
    "ring_no_sinks": ("loss_step1", True),
    # a windowed layer's needed step skipped; the visiting latent blocks' up-projection weight gradients dropped
    "ring_window_step_skipped": ("loss_step1", True),
    "ring_latent_weight_dropped": ("grads", False),
    # document masking: a cp rank attending across documents, positions running on across documents
    "mask_cp_rank": ("loss_step1", True),
    "mask_no_reset": ("loss_step1", True),
    # Muon: the optimizer acts after step 1's forward and backward, so the weights break first
    "muon_local_ns": ("weights", False),
    "muon_fused_one_matrix": ("weights", False),
    "muon_not_scattered": ("weights", False),
    # MoE: the bias update acts after step 1, the aux loss is in the gradient only (the logged loss is the CE)
    "moe_local_loads": ("biases", False),
    "moe_aux_per_rank": ("grads", False),
    "moe_expert_fsdp_average": ("grads", False),
    "moe_router_not_over_tp": ("grads", False),
    "moe_aux_counts_not_over_tp": ("grads", False),
    # gpt-oss: the window's bound, the window's positions under cp, the sinks under cp and tp, the experts' clamp
    "window_off_by_one": ("loss_step1", True),
    "window_local": ("loss_step1", True),
    "sinks_dropped": ("loss_step1", True),
    "sinks_not_split": ("loss_step1", True),
    "clamp_missing": ("loss_step1", True),
    "hf_window_dropped": ("loss_step1", True),
    # DeepSeek-V3: the bias in the weights shows after the first bias update (the validation between steps); the
    # MTP shift leaves the logged loss (next-token) alone, its depth loss (compared with the loss) moves at step 1
    "ds_rope_on_nope": ("loss_step1", True),
    "ds_cp_latent_no_rope": ("loss_step1", True),
    "ds_cp_local_shift": ("loss_step1", True),
    "ds_latent_norm_unsplit": ("loss_step1", True),  # the depth loss (compared with the loss) at step 1
    "ds_bias_in_weights": ("eval", False),  # the forward after step 1's bias update
    "ds_no_group_limit": ("loss_step1", True),
    "ds_mtp_shift": ("loss_step1", True),
    "ds_latent_replicated": ("grads", False),
    "ds_stream_linear_unsummed": ("grads", False),  # torch 2.11's fix: the local matmul's Partial gradient
    # Qwen3-Next: linear attention's cp by state passing and the Gated DeltaNet / shared-expert gates (forward)
    "cp_state_not_passed": ("loss_step1", True),
    "cp_scan_rank_order": ("loss_step1", True),
    "cp_no_conv_halo": ("loss_step1", True),
    "delta_no_reset": ("loss_step1", True),
    "delta_decay_sign": ("loss_step1", True),
    "delta_beta_raw": ("loss_step1", True),
    "no_shared_gate": ("loss_step1", True),
}
BROKEN = gate.BROKEN  # a mutation must move its metric by at least this much (the tolerance is 1e-10)


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"world{n}")
def gate_results(request, tmp_path_factory):
    world = request.param
    results = shared_launch.results("gate", world, request, tmp_path_factory)  # one launch per world size
    print(f"\ngate world size {world} (max |diff| over 3 steps):")
    for name, r in results["layouts"].items():
        print(
            f"  {name:45s} loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} grads {r['grads']:.1e} "
            f"weights {r['weights']:.1e}  {r['seconds']} s"
        )
    return world, results


def test_every_layout_of_the_world_size_ran(gate_results):
    world, results = gate_results
    expected = {layout.name for layout in gate.LAYOUTS if layout.world_size == world}
    assert set(results["layouts"]) == expected


def test_layouts_train_exactly_like_one_device(gate_results):
    world, results = gate_results
    bad = {}
    for name, r in results["layouts"].items():
        if r["mutation"]:
            continue
        if not r["ok"]:
            bad[name] = {
                k: r[k]
                for k in (
                    "init",
                    "grad_placements",
                    "loss",
                    "grad_norm",
                    "grads",
                    "weights",
                    "biases",
                    "eval",
                    "coverage",
                    "tied_still_tied",
                )
            }
        # Clipping acted on every step (the reference norm exceeds max_norm), so it was tested too.
        assert min(r["ref_grad_norms"]) > 2 * r["max_norm"], name
    assert not bad, f"layouts differ from one device by more than {gate.TOL}: {bad}"


def test_every_layout_starts_from_the_single_device_init_exactly(gate_results):
    """The sharded init (each rank generates only its shards; titanlike.init) gives bit-identical initial weights
    under every layout, uneven FSDP shards, TP x FSDP (_StridedShard) and fused c_attn included."""
    world, results = gate_results
    by_name = {layout.name: layout for layout in gate.LAYOUTS}
    sharded = [n for n, r in results["layouts"].items() if not r["mutation"] and by_name[n].init == "sharded"]
    assert sharded
    for name in sharded:
        assert results["layouts"][name]["init"] == 0.0, name


def test_mutations_break_the_gate(gate_results):
    world, results = gate_results
    for name, r in results["layouts"].items():
        if not r["mutation"]:
            continue
        field, forward_breaks = EXPECTED_BREAK[r["mutation"]]
        assert not r["ok"], f"{name}: the gate did not notice the mutation"
        assert r[field] > BROKEN, f"{name}: expected {field} to break, got {r}"
        if not forward_breaks:
            assert r["loss_step1"] <= gate.TOL, f"{name}: expected a correct forward, got {r['loss_step1']}"


def test_matrix_covers_the_required_layouts():
    by_name = {layout.name: layout for layout in gate.LAYOUTS}
    required = [
        "tp2",
        "tp2_sp",
        "tp4_gqa",
        "tp2_no_loss_parallel",
        "fsdp2",
        "fsdp4",
        "hsdp2x2",
        "tp2_fsdp2",
        "tp2_sp_fsdp2",
        "tp2_hsdp2x2",
        "fsdp2_accum2",
        "tp2_tied",
        "fsdp2_tied",
        "cp2",
        "cp4",
        "cp2_tp2_sp",
        "cp2_fsdp2",
        "cp2_tp2_fsdp2",
        "gpt2 cp2",
        "gpt2 cp2_tp2_sp",
        "qwen3 tp2",
        "qwen3 tp2_sp",
        "qwen3 fsdp2",
        "qwen3 hsdp2x2",
        "qwen3 cp2",
        "qnext cp2",
        "qnext cp4",
        "qnext_block cp2",
        "qnext_block cp4",
        "qnext tp2_sp_ep2",
        "qnext_block tp2_sp_ep2",
        "qnext fsdp2",
        "qnext ep2",
        "qnext cp2_tp2_sp_ep2",
        "muon fsdp2",
        "muon tp2_sp",
        "muon cp2",
        "muon gpt2 tp2_sp",
        "muon tp2_sp_fsdp2 small buckets",
        "muon gpt2 tp2_fsdp2",
        "moe ep2",
        "moe cp2_ep2",
        "moe ep2_fsdp4",
        *[f"{m} {k}" for m in ("gpt_oss", "gpt_oss_block") for k in ("tp2_sp_ep2", "fsdp2", "cp2", "ep2")],
        "ring gpt_oss_narrow cp4",  # the ring's windowed layer skipping a step
        "ring ds_cp cp2_fsdp2",  # the latent ring's visiting weight gradients under FSDP
        "ring ds_cp_block cp2_tp2_sp_ep2",  # ... under tp (wkv_b column-sharded)
    ]
    assert all(n in by_name for n in required)
    assert {layout.mutation for layout in gate.LAYOUTS if layout.mutation} == set(EXPECTED_BREAK)


def _compiled(layout) -> bool:
    return "--compile.enable" in layout.args


# graph breaks per compiled layout (every break dynamo logs, over both steps that compile): none, but for MoE blocks
# under expert parallelism (compiled without fullgraph, titanlike/parallel/compile.py): the dynamo-disabled forward
# hooks of the FSDP groups inside the block (the experts', the MoE block's under ep borrowing tp), and with the uneven
# dispatch its data-dependent split-size check; the padded dispatch has only the hooks' (docs/performance.md)
COMPILE_BREAKS = {
    "compile moe tp2_sp_ep2": 8,
    "compile moe tp2_sp_ep2 padded": 4,
    "compile moe cp2_tp2_sp_ep2": 8,
    "compile gpt_oss cp2_tp2_sp_ep2": 10,
    "compile ds cp2_tp2_sp_ep2": 9,
    "compile qnext cp2_tp2_sp_ep2": 10,
}


def test_compiled_layouts_capture_whole_blocks_and_stop_compiling(gate_results):
    """The compiled layouts (blocks compiled with fullgraph, aot_eager; every family under cp 2 x tp 2 + SP, x ep 2
    for the MoE ones) train like one device (the test above) with no graph break, but those of MoE blocks under
    expert parallelism (pinned), and nothing compiled after the second step: every rank's
    graph count after step 3 equals its count after step 2 (the MoE routing differs every step)."""
    world, results = gate_results
    compiled = {n: r["compile"] for n, r in results["layouts"].items() if r["compile"]}
    assert sorted(compiled) == sorted(lo.name for lo in gate.LAYOUTS if lo.world_size == world and _compiled(lo))
    for name, c in compiled.items():
        graphs = c["graphs_after_step"]
        assert len(graphs) == gate.STEPS and graphs[0] >= 1 and graphs[-1] == graphs[1], (name, c)
        assert c["graph_breaks"] == COMPILE_BREAKS.get(name, 0), (name, c)


def test_experts_are_split_over_ep_and_each_moe_layer_costs_five_all_to_alls(gate_results):
    """Under ep the routed experts are 2-D DTensors (dp_shard_mod_ep, ep); a step's collectives (CommDebugMode,
    forward and backward) hold exactly 3 all-to-alls forward (counts, dispatch, combine) and 2 backward per MoE
    layer (the tiny model has one; the padded dispatch has no counts exchange: 2 and 2); without ep the experts are
    FSDP-sharded like any weight, with no all-to-all. Under op-level selective AC the all-to-alls are saved (still
    5), under full AC the forward's 3 are recomputed (8)."""
    world, results = gate_results
    # (the compiled layouts are not counted: CommDebugMode's dispatch mode would keep dynamo from tracing)
    moe = {
        n: r for n, r in results["layouts"].items() if r["model"] == "moe" and not r["mutation"] and not r["compile"]
    }
    # every MoE layout of this world size ran (the 8-rank launch has none)
    assert sorted(moe) == sorted(
        layout.name
        for layout in gate.LAYOUTS
        if layout.world_size == world and layout.model == "moe" and not layout.mutation and not _compiled(layout)
    )
    ep = {layout.name: "--parallelism.expert_parallel_degree" in layout.args for layout in gate.LAYOUTS}
    for name, r in moe.items():
        a2a = sum(v for k, v in r["expert_comms"].items() if "all_to_all" in k)
        if ep[name]:
            expected = 8 if "ac_full" in name else 4 if "padded" in name else 5  # padded: no counts exchange
            assert r["expert_mesh"][-2:] == ["dp_shard_mod_ep", "ep"] and a2a == expected, (name, r["expert_comms"])
        else:
            assert "ep" not in r["expert_mesh"] and a2a == 0, (name, r["expert_comms"])  # FSDP's dp_shard only


def test_muon_orthogonalizes_every_matrix_once_dividing_the_work(gate_results):
    """Under every Muon layout each matrix (GPT-2's q, k and v each) was orthogonalized by exactly one rank per step,
    the owners spread over the ranks (at most ceil(matrices / world) each), and each rank exchanged blocks in two
    all-to-alls per bucket of matrices (one bucket, or buckets of one matrix per rank) and nothing else (pinned with
    CommDebugMode)."""
    world, results = gate_results
    muon = {n: r for n, r in results["layouts"].items() if r["model"] in gate.MUON_MATRICES and not r["mutation"]}
    assert muon or world == 8
    for name, r in muon.items():
        counts = [s["matrices"] for s in r["muon_stats"]]
        total = gate.MUON_MATRICES[r["model"]]
        assert sum(counts) == total and max(counts) <= -(-total // world), (name, counts)
        buckets = -(-total // world) if r["model"] == "muon_small_buckets" else 1
        assert all(s["collectives"] == 2 * buckets for s in r["muon_stats"]), (name, r["muon_stats"])
        # CommDebugMode saw exactly those all-to-alls in the optimizer step, and no other collective
        assert all(s["comms"] == {"c10d.alltoall_base_": 2 * buckets} for s in r["muon_stats"]), name
        assert all(s["sent"] > 0 and s["received"] > 0 for s in r["muon_stats"]), name


def test_the_planner_predicts_every_ranks_muon_step(gate_results):
    """titanlike.planner.muon's matrices, Newton-Schulz FLOPs, all-to-alls and elements sent / received per rank
    equal the real optimizer's counts under every Muon layout of the launch."""
    world, results = gate_results
    problems = gate.planner_muon_mismatches(results, gate.LAYOUTS, world)
    assert problems[:-1] == [] and (problems[-1] != "compared 0" or world == 8), problems


def test_grouped_query_fused_qkv_under_tp2_fsdp2(gate_results):
    """A user block with a fused q|k|v of unequal chunks (4 heads, 2 kv heads: 16|8|8), tp-replicated and cut per
    rank in the forward, under tp2 x fsdp2 (tests/parallel/tp_probe_worker.py, run in the 4-rank gate launch)."""
    world, results = gate_results
    if world != 4:
        assert not results["probes"]
        return
    probe = results["probes"]["fused_gqa tp2_fsdp2"]
    # FSDP shards the tp-replicated weight over dp like any replicated parameter; gate|up keeps its strided layout.
    assert probe["placements"] == {
        "attn.qkv.weight": "(Shard(dim=0), Replicate())",
        "attn.qkv.bias": "(Shard(dim=0), Replicate())",
        "ffn.gate_up.weight": "(Shard(dim=1), _StridedShard(dim=0, sf=2))",
    }
    assert probe["full_tensor_in_order"]
    assert probe["train_diff"] <= gate.TOL, probe
    assert probe["dcp"]["fresh_differs_before_load"] > 0.1
    assert probe["dcp"]["same_layout_diff"] == 0.0 and probe["dcp"]["one_process_diff"] == 0.0
    # Mutation: the rows' gradient taken as Replicate (no Partial sum over tp): FSDP does not reduce it.
    mutation = probe["mutation no_partial_grad"]
    assert mutation["diff"] > BROKEN and mutation["loss_step1"] <= gate.TOL, mutation


def test_zero1_holds_half_the_moments_and_all_gathers_once_per_parameter(gate_results):
    """ZeRO-1 at dp 2: each rank holds half of AdamW's moments (rows split by torch.chunk) and the step's only
    collectives are one all-gather per parameter (of its rows, updated by the rank that holds their moments); the
    gradients' all-reduce is FSDP's, in the backward."""
    world, results = gate_results
    zero1 = {n: r for n, r in results["layouts"].items() if r.get("zero1") and not r["mutation"]}
    assert (world == 2) == bool(zero1), sorted(zero1)
    for name, r in zero1.items():
        z = r["zero1"]
        assert 0.45 < z["held"] <= 0.55, (name, z)
        assert z["comms"] == {"c10d_functional.all_gather_into_tensor": z["params"]}, (name, z)
