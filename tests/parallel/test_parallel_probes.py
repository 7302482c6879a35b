"""Two-rank probes (tests/parallel/tp_probe_worker.py, one launch): collective counts and bytes under tp 2, a user's
own module under apply_tp / apply_fsdp, FSDP mixed precision, cross-stage clipping, apply_tp's errors."""

import math

import pytest
import shared_launch
import torch

# The tiny gate model: batch 8 x seq 16 x dim 64 in float64 = one activation of 65536 bytes; 2 blocks;
# vocab 128; the vocab-parallel CE all-reduces 3 vectors of 128 rows (1024 bytes each); a norm weight is 512 bytes.
ACT, ROWS, NORM, LOGITS = 8 * 16 * 64 * 8, 8 * 16 * 8, 64 * 8, 8 * 16 * 128 * 8


@pytest.fixture(scope="module")
def probes(request, tmp_path_factory):
    return shared_launch.results("probes", 2, request, tmp_path_factory)  # in the session's 2-rank launch


def test_one_block_two_all_reduces_each_way_without_sp(probes):
    block = probes["comms"]["block sp=False"]
    assert block["forward"] == {"all_reduce": [2, 2 * ACT]}  # g: after wo and after w2
    assert block["backward"] == {"all_reduce": [2, 2 * ACT]}  # f: at the attention and feed-forward entries


def test_one_block_with_sp_swaps_each_all_reduce_for_a_reduce_scatter_and_an_all_gather(probes):
    plain, sp = probes["comms"]["block sp=False"], probes["comms"]["block sp=True"]
    for direction in ("forward", "backward"):
        count, nbytes = plain[direction]["all_reduce"]
        assert sp[direction]["all_gather_into_tensor"] == [count, nbytes]
        assert sp[direction]["reduce_scatter_tensor"] == [count, nbytes]
    assert "all_reduce" not in sp["forward"]
    # The only extra: the two norm weights' gradients, computed from different sequence shards, are summed.
    assert sp["backward"]["all_reduce"] == [2, 2 * NORM]
    assert len(sp["forward"]) == 2 and len(sp["backward"]) == 3


def test_whole_model_collectives_are_pinned(probes):
    """Embedding + 2 blocks + final norm + head + vocab-parallel loss: any extra redistribution fails here."""
    comms = probes["comms"]
    ce = [3, 3 * ROWS]  # max, sum-exp, target logit
    assert comms["model sp=False lp=True"] == {
        "forward": {"all_reduce": [1 + 4 + 3, 5 * ACT + 3 * ROWS]},  # embedding, blocks, loss
        "backward": {"all_reduce": [4 + 1, 5 * ACT]},  # blocks, head input (f)
    }
    assert comms["model sp=True lp=True"] == {
        "forward": {
            "reduce_scatter_tensor": [1 + 4, 5 * ACT],
            "all_gather_into_tensor": [4 + 1, 5 * ACT],
            "all_reduce": ce,
        },
        "backward": {
            "reduce_scatter_tensor": [4 + 1, 5 * ACT],
            "all_gather_into_tensor": [4 + 1, 5 * ACT],
            "all_reduce": [5, 5 * NORM],
        },  # 2 norm weights per block + the final norm
    }
    assert comms["model sp=False lp=False"] == {  # the head all-gathers the logits, the loss needs nothing
        "forward": {"all_reduce": [5, 5 * ACT], "all_gather_into_tensor": [1, LOGITS]},
        "backward": {"all_reduce": [5, 5 * ACT]},
    }
    assert comms["model sp=True lp=False"]["forward"]["all_gather_into_tensor"] == [6, 5 * ACT + LOGITS]


def test_a_users_own_module_with_a_user_plan_matches_one_device(probes):
    user = probes["user_module"]
    assert user["tp_diff"] <= 1e-12 and user["fsdp_diff"] <= 1e-12, user
    assert user["tp_placements"] == {
        "ln.weight": ["R"],
        "ln.bias": ["R"],
        "up.weight": ["S(0)"],
        "up.bias": ["S(0)"],
        "gate.weight": ["S(0)"],
        "gate.bias": ["S(0)"],
        "down.weight": ["S(1)"],
        "down.bias": ["R"],
    }


def test_bf16_training_uses_fsdp_mixed_precision(probes):
    mp = probes["mixed_precision"]
    assert mp["logits_dtype"] == "torch.bfloat16"  # bf16 compute
    assert mp["param_dtypes"] == ["torch.float32"] and mp["param_types"] == ["DTensor"]  # fp32 sharded master
    assert mp["grad_dtypes"] == ["torch.float32"]  # fp32 reduction
    assert mp["loss_rel_diff"] < 1e-2


def test_clip_sums_squared_norms_across_pipeline_stages(probes):
    ok, dropped = probes["clip_pp"]["reduce=True"], probes["clip_pp"]["reduce=False"]
    assert ok["norms"] == [pytest.approx(math.sqrt(20))] * 2  # identical on both stages
    assert ok["grad0"] == pytest.approx(1 / math.sqrt(20), rel=1e-5)  # rank 0's grads: 1 * max_norm / norm
    assert ok["extra"] == pytest.approx(10 / math.sqrt(20), rel=1e-5)  # clipped though not counted
    assert dropped["norms"] == [pytest.approx(2.0), pytest.approx(4.0)]  # the mutation: stages disagree


def test_apply_tp_errors_name_the_fix(probes):
    errors = probes["errors"]
    assert "match no submodule" in errors["unknown key"] and "wqq" in errors["unknown key"]
    assert "tied parameters 'tok_embeddings.weight' and 'output.weight'" in errors["tied different layouts"]


def test_fused_projections_keep_the_single_device_order_and_the_unfused_collectives(probes):
    fused = probes["fused"]
    assert fused["full_tensor_in_order"] and fused["local_is_chunk_slices"], fused
    if torch.__version__ >= "2.13":
        assert fused["torch_full_tensor_in_order"], fused["torch_full_tensor_error"]
    else:  # torch 2.11 cannot plan a redistribute of a _StridedShard whose split factor is no product of mesh sizes
        assert "unable to be interpreted into a corresponding shard_order" in fused["torch_full_tensor_error"]
    assert "_StridedShard(dim=0, sf=3)" in fused["placements"]
    # the strided gather (torch 2.11 refuses redistribute from _StridedShard): the whole tensor, Replicate over tp
    assert fused["gather_strided_exact"], fused["gather_strided"]
    strided = {f"{m}.{p}" for m in ("attn.qkv", "ffn.gate_up") for p in ("weight", "bias")}
    assert set(fused["gather_strided"]) == strided
    assert set(fused["gather_strided"].values()) == {"(Replicate(),)"}
    # One all-reduce per block half each way, exactly like separate q / k / v and gate / up projections.
    assert fused["comms"]["fused"] == fused["comms"]["split"], fused["comms"]
    assert fused["comms"]["fused"]["forward"] == {"all_reduce": [2, 2 * 4 * 6 * 16 * 8]}
    assert fused["comms"]["fused"]["backward"]["all_reduce"][0] == 2
    assert fused["train_diff"] <= 1e-10, fused["train_diff"]  # the gate's bar (AdamW on near-zero grads)
    assert fused["dcp_tp2_to_one_process_diff"] == 0.0


# The grouped-query block: d 16, 4 heads, 2 kv heads, head dim 4 -> q|k|v = 16|8|8 (a fused Linear of 32 x 16 with
# bias), batch 4 x seq 6. Its price under tp: one all-reduce of the weight's gradient, one of the bias's, per step.
GQA_ACT = 4 * 6 * 16 * 8
GQA_EXTRA = [2, 32 * 16 * 8 + 32 * 8]


def test_grouped_query_fused_qkv_is_tp_replicated_cut_per_rank_and_trains_like_one_device(probes):
    gqa = probes["fused_gqa"]
    assert gqa["sizes"] == [16, 8, 8]
    # Unequal chunks stay Replicate over tp (single-device order everywhere); equal gate|up keeps _StridedShard.
    assert gqa["placements"] == {
        "attn.qkv.weight": "(Replicate(),)",
        "attn.qkv.bias": "(Replicate(),)",
        "ffn.gate_up.weight": "(_StridedShard(dim=0, sf=2),)",
    }
    assert gqa["full_tensor_in_order"]
    assert gqa["local_output_vs_chunk_slices"] == 0.0  # rank r's output: [q_r | k_r | v_r] of the one-device output
    assert gqa["train_diff sp=False"] <= 1e-10 and gqa["train_diff sp=True"] <= 1e-10, gqa
    assert gqa["dcp"]["fresh_differs_before_load"] > 0.1
    assert gqa["dcp"]["same_layout_diff"] == 0.0 and gqa["dcp"]["one_process_diff"] == 0.0


def test_grouped_query_fused_qkv_costs_the_unfused_collectives_plus_two_gradient_all_reduces(probes):
    gqa = probes["fused_gqa"]
    for sp in (False, True):
        fused, split = gqa[f"comms sp={sp}"]["fused"], gqa[f"comms sp={sp}"]["split"]
        assert fused["forward"] == split["forward"], (sp, fused, split)
        extra = {
            **split["backward"],
            "all_reduce": [a + b for a, b in zip(split["backward"].get("all_reduce", [0, 0]), GQA_EXTRA, strict=True)],
        }
        assert fused["backward"] == extra, (sp, fused, split)
    plain = gqa["comms sp=False"]["split"]
    assert plain == {"forward": {"all_reduce": [2, 2 * GQA_ACT]}, "backward": {"all_reduce": [2, 2 * GQA_ACT]}}


def test_grouped_query_fused_qkv_mutations_break_it(probes):
    gqa = probes["fused_gqa"]
    # Rank-major rows (what ColwiseParallel gives): q heads used as k and v, the forward is wrong.
    assert gqa["mutation rank_major_rows"]["loss_step1"] > 1e-6
    # Right rows, gradient not summed over tp: the forward is right, gradients and weights are not.
    no_partial = gqa["mutation no_partial_grad"]
    assert no_partial["loss_step1"] <= 1e-12 and no_partial["diff"] > 1e-6, no_partial


def test_silent_no_ops_are_one_line_errors_at_apply_time(probes):
    errors = probes["errors"]
    assert "UserMLP is not a registered model, so there is no default plan; pass plan=" in errors["no default plan"]
    assert (
        "the plan leaves the parameters of ln plain tensors next to DTensors" in errors["module left out of the plan"]
    )
    assert "ReplicateParallel()" in errors["module left out of the plan"]
    assert "UserMLP has no block container (.layers) and no model spec" in errors["fsdp without blocks"]
    assert "pass blocks=[...]" in errors["fsdp without blocks"]
    assert "chunk sizes [12, 3, 3] must each divide by tp 2" in errors["fused chunks not divisible by tp"]
    assert (
        "chunk sizes [16, 8, 8] hold [2.0, 1.0, 1.0] heads of 8; each chunk's head count must divide by tp 2"
        in errors["fused kv heads not divisible by tp"]
    )
    assert "chunk sizes [16, 8, 8] differ" in errors["fused unequal chunks as a DTensor output"]
    assert "use_local_output=True" in errors["fused unequal chunks as a DTensor output"]
    assert all("\n" not in e for e in errors.values())
