"""The planted mutations of the equality gates (tests/parallel/gate.py MUTATIONS, pipeline_gate.py) localised, and
clean layouts reported clean: every case of a world size in ONE launch of forked gloo ranks, one JSON for
tests/localize/test_localize_mutations.py.

    python tests/localize/localize_worker.py --world-size 2 --out loc2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "parallel")]

# the gate's debug-model shape: tiny (dim 64, 2 layers, 4 heads, 2 kv heads), 16 tokens, 8 rows, clipping that acts
TRAIN = (
    "--training.seq_len", "16", "--training.global_batch_size", "8", "--training.max_norm", "0.05",
    "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.1",
)  # fmt: skip
BASE = ("--model.flavor", "tiny", "--model.dim", "64", "--model.max_seq_len", "16", *TRAIN)
TP = ("--parallelism.tensor_parallel_degree", "2")
SP = ("--parallelism.enable_sequence_parallel", "true")
CP = ("--parallelism.context_parallel_degree", "2")
A2A = (*CP, "--parallelism.context_parallel_method", "alltoall")
RING = (*CP, "--parallelism.context_parallel_method", "ring")
ZERO1 = ("--parallelism.distributed_optimizer", "true")
CPU_OFFLOAD = ("--training.enable_cpu_offload", "true")
ACT_OFFLOAD = ("--activation_checkpoint.offload", "true")


def dp(replicate: int, shard: int, local: int) -> tuple[str, ...]:
    return (
        "--parallelism.data_parallel_replicate_degree", str(replicate), "--parallelism.data_parallel_shard_degree",
        str(shard), "--training.local_batch_size", str(local),
    )  # fmt: skip


GPT2 = ("--model.name", "gpt2")
QWEN3 = ("--model.name", "qwen3")
MUON = ("--optimizer.name", "Muon", "--optimizer.ns_dtype", "float64")
BLOCK = ("--model.attn_mask_type", "block_causal")
RESET = ("--model.reset_position_ids", "true")
MOE = ("--model.name", "qwen3_moe")
EP = ("--parallelism.expert_parallel_degree", "2")
DEEP = ("--model.n_layers", "8")
DEEP_TIED = (*DEEP, "--model.tie_embeddings", "true")
GPT_OSS = ("--model.name", "gpt_oss")
DS = ("--model.name", "deepseek_v3")
DS_NO_MTP = (*DS, "--model.mtp_layers", "0")
QNEXT = ("--model.name", "qwen3_next")
TP_SP_EP = (*EP, *TP, *SP, *dp(1, 1, 8))


def hf(key: str, **changes) -> tuple[str, ...]:
    from hf_models import hf_folder

    return ("--model.name", "hf", "--model.hf_config", hf_folder(key, **changes))


def pp(degree: int, schedule: str, local: int, microbatch: int = 1) -> tuple[str, ...]:
    return (
        "--parallelism.pipeline_parallel_degree", str(degree), "--parallelism.pipeline_parallel_schedule", schedule,
        "--training.local_batch_size", str(local), "--parallelism.pipeline_parallel_microbatch_size", str(microbatch),
    )  # fmt: skip


# name -> (world size, train.py flags, mutation of gate.MUTATIONS or None)
CASES = {
    "tp2_sp": (2, (*TP, *SP, *dp(1, 1, 8)), None),
    "fsdp2": (2, dp(1, 2, 4), None),
    "cp2": (2, (*CP, *dp(1, 1, 8)), None),
    "tp2_ac_full": (2, (*TP, "--activation_checkpoint.mode", "full", *dp(1, 1, 8)), None),
    "cp2_ac_selective_op": (2, (*CP, "--activation_checkpoint.mode", "selective", *dp(1, 1, 8)), None),
    "gpt2 tp2_sp_accum2": (2, (*GPT2, *TP, *SP, *dp(1, 1, 4)), None),
    "MUT tp2 no f backward all-reduce": (2, (*TP, *dp(1, 1, 8)), "tp_no_backward_reduce"),
    "MUT tp2_sp no f backward reduce-scatter": (2, (*TP, *SP, *dp(1, 1, 8)), "tp_no_backward_reduce"),
    "MUT tp2 CE without max all-reduce": (2, (*TP, *dp(1, 1, 8)), "ce_no_max_all_reduce"),
    "MUT tp2_sp norms not sequence-parallel": (2, (*TP, *SP, *dp(1, 1, 8)), "sp_norm_plain"),
    "MUT fsdp2 loss averaged per rank": (2, dp(1, 2, 4), "loss_mean_per_rank"),
    "MUT fsdp2 gradients averaged": (2, dp(1, 2, 4), "fsdp_average"),
    "MUT gpt2 tp2 c_attn plain ColwiseParallel": (2, (*GPT2, *TP, *dp(1, 1, 8)), "fused_plain_colwise"),
    "MUT tp2_sp to_empty drops the gradient hooks": (2, (*TP, *SP, *dp(1, 1, 8)), "to_empty_drops_grad_hooks"),
    "MUT fsdp2 init ignores the shards": (2, dp(1, 2, 4), "init_ignores_shards"),
    "MUT gpt2 tp2 init of fused c_attn as a plain shard": (2, (*GPT2, *TP, *dp(1, 1, 8)), "init_strided_as_shard"),
    "MUT cp2 K/V grads not reduce-scattered": (2, (*CP, *dp(1, 1, 8)), "cp_kv_grad_not_reduced"),
    "MUT cp2 chunks in wrong order": (2, (*CP, *dp(1, 1, 8)), "cp_chunks_wrong_order"),
    "MUT cp2 RoPE local positions": (2, (*CP, *dp(1, 1, 8)), "cp_rope_local"),
    "MUT cp2 loss tokens per cp rank": (2, (*CP, *dp(1, 1, 8)), "cp_tokens_per_rank"),
    "MUT qwen3 tp2_sp q/k norms ReplicateParallel": (2, (*QWEN3, *TP, *SP, *dp(1, 1, 8)), "qk_norm_replicated"),
    "MUT muon fsdp2 Newton-Schulz on the local shard": (2, (*MUON, *dp(1, 2, 4)), "muon_local_ns"),
    "MUT muon gpt2 tp2 c_attn orthogonalized as one matrix": (
        2,
        (*MUON, *GPT2, *TP, *dp(1, 1, 8)),
        "muon_fused_one_matrix",
    ),
    "MUT muon tp2 owner's result not scattered": (2, (*MUON, *TP, *dp(1, 1, 8)), "muon_not_scattered"),
    "MUT block cp2 rank 1 ignores documents": (2, (*BLOCK, *CP, *dp(1, 1, 8)), "mask_cp_rank"),
    "MUT gpt2 block fsdp2 positions not reset": (2, (*GPT2, *BLOCK, *RESET, *dp(1, 2, 4)), "mask_no_reset"),
    "moe ep2": (2, (*MOE, *EP, *dp(1, 2, 4)), None),
    "moe tp2_sp_ep2": (2, (*MOE, *EP, *TP, *SP, *dp(1, 1, 8)), None),
    "MUT moe tp2_sp_ep2 router not summed over tp": (2, (*MOE, *EP, *TP, *SP, *dp(1, 1, 8)), "moe_router_not_over_tp"),
    "MUT moe tp2_sp_ep2 aux counts not over tp": (2, (*MOE, *EP, *TP, *SP, *dp(1, 1, 8)), "moe_aux_counts_not_over_tp"),
    "MUT moe ep2 bias update from local loads": (2, (*MOE, *EP, *dp(1, 2, 4)), "moe_local_loads"),
    "MUT moe ep2 aux loss per rank": (2, (*MOE, *EP, *dp(1, 2, 4)), "moe_aux_per_rank"),
    "MUT moe ep2_fsdp4 expert FSDP averaging": (4, (*MOE, *EP, *dp(1, 4, 2)), "moe_expert_fsdp_average"),
    "MUT fsdp2 validation leaves FSDP unsharded": (2, dp(1, 2, 4), "eval_keeps_unsharded"),
    "MUT moe pp2 1F1B metadata inference counted as routed tokens": (
        2,
        (*MOE, "--model.n_layers", "4", *pp(2, "1F1B", 8, 2)),
        "pp_moe_inference_counted",
    ),
    "moe pp2 1F1B": (2, (*MOE, "--model.n_layers", "4", *pp(2, "1F1B", 8, 2)), None),
    "pp2 1F1B tied": (2, (*DEEP_TIED, *pp(2, "1F1B", 8, 2)), None),
    "pp2 ZBVZeroBubble": (2, (*DEEP, *pp(2, "ZBVZeroBubble", 8, 2)), None),
    "MUT pp2 microbatch loss / m": (2, (*DEEP, *pp(2, "1F1B", 8, 2)), "pp_loss_over_microbatches"),
    "MUT pp2 norm not reduced over stages": (2, (*DEEP, *pp(2, "1F1B", 8, 2)), "pp_norm_not_reduced"),
    "MUT pp2 tied weight counted twice in norm": (2, (*DEEP_TIED, *pp(2, "1F1B", 8, 2)), "pp_tied_norm_twice"),
    "MUT pp2 tied grads not summed": (2, (*DEEP_TIED, *pp(2, "1F1B", 8, 2)), "pp_tied_not_summed"),
    "MUT block pp2 ZBVZeroBubble microbatch given another's starts": (
        2,
        (*DEEP, *BLOCK, *RESET, *pp(2, "ZBVZeroBubble", 8, 2)),
        "pp_starts_other_microbatch",
    ),
    "MUT pp2 fsdp2 ZBVZeroBubble resharding after forward": (
        4,
        (*DEEP, *pp(2, "ZBVZeroBubble", 4), *dp(1, 2, 4)),
        "pp_fsdp_reshard_after_forward",
    ),
    "MUT pp2 1F1B uneven split runs a boundary block twice": (
        2,
        ("--model.n_layers", "5", *pp(2, "1F1B", 8, 2)),
        "pp_split_block_twice",
    ),
    "pp2 tp2_sp 1F1B": (4, (*DEEP, *TP, *SP, *pp(2, "1F1B", 8, 2)), None),
    "tp2_fsdp2": (4, (*TP, *dp(1, 2, 4)), None),
    "cp2_fsdp2": (4, (*CP, *dp(1, 2, 4)), None),
    "hsdp2x2": (4, dp(2, 2, 2), None),
    "tp2_sp_fsdp2": (4, (*TP, *SP, *dp(1, 2, 4)), None),
    "cp2_tp2_sp": (4, (*CP, *TP, *SP, *dp(1, 1, 8)), None),
    "MUT hsdp2x2 gradients averaged": (4, dp(2, 2, 2), "fsdp_average"),
    # gpt-oss: the sliding window, the sinks, the clamped experts
    "gpt_oss tp2_sp_ep2": (2, (*GPT_OSS, *TP_SP_EP), None),
    "gpt_oss_block cp2": (2, (*GPT_OSS, *BLOCK, *CP, *dp(1, 1, 8)), None),
    "hf_mistral_window fsdp2": (2, dp(1, 2, 4), None),
    "MUT gpt_oss fsdp2 window off by one": (2, (*GPT_OSS, *dp(1, 2, 4)), "window_off_by_one"),
    "MUT gpt_oss cp2 window on local positions": (2, (*GPT_OSS, *CP, *dp(1, 1, 8)), "window_local"),
    "MUT gpt_oss_block cp2 sinks dropped": (2, (*GPT_OSS, *BLOCK, *CP, *dp(1, 1, 8)), "sinks_dropped"),
    "MUT gpt_oss tp2_sp_ep2 sinks not split with their heads": (2, (*GPT_OSS, *TP_SP_EP), "sinks_not_split"),
    "MUT gpt_oss ep2 clamp missing": (2, (*GPT_OSS, *EP, *dp(1, 2, 4)), "clamp_missing"),
    "MUT hf_mistral_window fsdp2 window dropped": (2, dp(1, 2, 4), "hf_window_dropped"),
    # DeepSeek-V3: MLA's latent and RoPE key, the routing, the MTP depth
    "ds ep2": (2, (*DS, *EP, *dp(1, 2, 4)), None),
    "ds tp2_sp_ep2": (2, (*DS, *TP_SP_EP), None),
    "ds cp2_ep2": (2, (*DS, *EP, *CP, *dp(1, 1, 8)), None),
    "MUT ds fsdp2 RoPE on the non-rope part": (2, (*DS, *dp(1, 2, 4)), "ds_rope_on_nope"),
    "MUT ds_cp cp2 latent without the RoPE key": (2, (*DS_NO_MTP, *CP, *dp(1, 1, 8)), "ds_cp_latent_no_rope"),
    "MUT ds cp2 MTP labels shifted per rank": (2, (*DS, *CP, *dp(1, 1, 8)), "ds_cp_local_shift"),
    "MUT ds fsdp2 latent norm before the split": (2, (*DS, *dp(1, 2, 4)), "ds_latent_norm_unsplit"),
    "MUT ds ep2 correction bias in the weights": (2, (*DS, *EP, *dp(1, 2, 4)), "ds_bias_in_weights"),
    "MUT ds ep2 group limiting skipped": (2, (*DS, *EP, *dp(1, 2, 4)), "ds_no_group_limit"),
    "MUT ds fsdp2 MTP targets shifted by one": (2, (*DS, *dp(1, 2, 4)), "ds_mtp_shift"),
    "MUT ds tp2_sp_ep2 latent norm gradient not summed": (2, (*DS, *TP_SP_EP), "ds_latent_replicated"),
    "MUT ds tp2_sp_ep2 MTP eh_proj gradient not summed": (2, (*DS, *TP_SP_EP), "ds_stream_linear_unsummed"),
    "MUT ds pp2 1F1B MTP tokens of another microbatch": (
        2,
        (*DS, "--model.n_layers", "4", *pp(2, "1F1B", 8, 2)),
        "pp_mtp_tokens_other_microbatch",
    ),
    # context parallelism by all-to-all (Ulysses) and by ring: the heads' order, the reverse all-to-all, the ring steps
    "a2a cp2": (2, (*A2A, *dp(1, 1, 8)), None),
    "ring cp2": (2, (*RING, *dp(1, 1, 8)), None),
    "MUT a2a cp2 heads scattered back in the wrong order": (2, (*A2A, *dp(1, 1, 8)), "a2a_heads_order"),
    "MUT a2a cp2 reverse all-to-all skipped in backward": (2, (*A2A, *dp(1, 1, 8)), "a2a_no_grad"),
    "MUT a2a gpt_oss cp2 every rank uses the first heads' sinks": (
        2,
        (*GPT_OSS, *A2A, *dp(1, 1, 8)),
        "a2a_sinks_heads",
    ),
    "MUT ring cp2 a ring step skipped": (2, (*RING, *dp(1, 1, 8)), "ring_step_skipped"),
    "MUT ring cp2 log-sum-exps merged by max": (2, (*RING, *dp(1, 1, 8)), "ring_merge_max"),
    "MUT ring cp2 dK / dV not passed home": (2, (*RING, *dp(1, 1, 8)), "ring_grads_kept"),
    "MUT ring gpt_oss_block cp2 sinks dropped": (2, (*GPT_OSS, *BLOCK, *RING, *dp(1, 1, 8)), "ring_no_sinks"),
    "MUT ring gpt_oss cp2 a window step skipped": (2, (*GPT_OSS, *RING, *dp(1, 1, 8)), "ring_window_step_skipped"),
    "MUT ring ds_cp cp2 visiting up-projection grads dropped": (
        2,
        (*DS_NO_MTP, *RING, *dp(1, 1, 8)),
        "ring_latent_weight_dropped",
    ),
    # Qwen3-Next: the linear attention's cp state passing, the gated delta rule, the shared expert's gate
    "qnext_block cp2": (2, (*QNEXT, *BLOCK, *CP, *dp(1, 1, 8)), None),
    "qnext tp2_sp_ep2": (2, (*QNEXT, *TP_SP_EP), None),
    "MUT qnext cp2 state not passed": (2, (*QNEXT, *CP, *dp(1, 1, 8)), "cp_state_not_passed"),
    "MUT qnext cp2 scan in placement order": (2, (*QNEXT, *CP, *dp(1, 1, 8)), "cp_scan_rank_order"),
    "MUT qnext cp2 conv halo missing": (2, (*QNEXT, *CP, *dp(1, 1, 8)), "cp_no_conv_halo"),
    "MUT qnext_block cp2 state not reset at a document start": (
        2,
        (*QNEXT, *BLOCK, *CP, *dp(1, 1, 8)),
        "delta_no_reset",
    ),
    "MUT qnext fsdp2 decay sign flipped": (2, (*QNEXT, *dp(1, 2, 4)), "delta_decay_sign"),
    "MUT qnext fsdp2 beta not a sigmoid": (2, (*QNEXT, *dp(1, 2, 4)), "delta_beta_raw"),
    "MUT qnext ep2 shared-expert gate missing": (2, (*QNEXT, *EP, *dp(1, 2, 4)), "no_shared_gate"),
    "MUT qnext tp2_sp_ep2 delta norm ReplicateParallel": (2, (*QNEXT, *TP_SP_EP), "qk_norm_replicated"),
    # the memory modes: ZeRO-1's update, FSDP's CPU offload, activation offload
    "ddp2 zero1": (2, (*ZERO1, *dp(2, 1, 4)), None),
    "MUT ddp2 zero1 shards not all-gathered": (2, (*ZERO1, *dp(2, 1, 4)), "zero1_not_all_gathered"),
    "MUT fsdp2 cpu offload stale device copy": (2, (*CPU_OFFLOAD, *dp(1, 2, 4)), "cpu_offload_stale_device_copy"),
    "MUT fsdp2 act offload stale tensor": (2, (*ACT_OFFLOAD, *dp(1, 2, 4)), "act_offload_stale"),
}
# mutations of the gates no case localises: name -> why (test_localize_mutations.test_every_mutation_has_a_case)
NOT_LOCALISED: dict[str, str] = {}
# transformers models: their shape from their config.json (written when the case runs), the gate's train flags
HF_ARGS = {
    name: lambda: hf("hf_mistral_window", vocab_size=2008)  # the test tokenizer's 2008 ids
    for name in ("hf_mistral_window fsdp2", "MUT hf_mistral_window fsdp2 window dropped")
}


@contextlib.contextmanager
def planted(gate, mutation: str | None):
    """The gate's mutation, and what the gate's own builders do for two of them: the loss group remembered for the
    per-cp-rank token count, the position reset left off the parallel model."""
    import titanlike.parallel

    if mutation is None:
        yield
        return
    real = titanlike.parallel.build_parallel_model

    def no_reset(model, *args, **kwargs):
        model.reset_position_ids = False
        return real(model, *args, **kwargs)

    real_group = titanlike.parallel.loss_group

    def remembering(dims):  # gate.loss_group_for_gate, on the unpatched loss_group
        group = real_group(dims)
        if dims.cp_enabled:
            gate._DP_ONLY[group] = dims.get_mesh("dp").get_group() if dims.dp_enabled else None
        return group

    with contextlib.ExitStack() as stack:
        stack.enter_context(gate.MUTATIONS[mutation]())
        if mutation == "cp_tokens_per_rank":
            stack.enter_context(gate.patched(titanlike.parallel, "loss_group", remembering))
        if mutation == "mask_no_reset":
            stack.enter_context(gate.patched(titanlike.parallel, "build_parallel_model", no_reset))
        yield


def rank_main(rank: int, world_size: int, out: str, only: list[str] | None = None) -> None:
    import logging

    import gate
    import pipeline_gate  # noqa: F401 - registers the pipeline mutations in gate.MUTATIONS

    from titanlike.localize.trainer import localize_config

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    dims_cache: dict = {}
    results = {}
    for name, (ws, args, mutation) in CASES.items():
        if ws != world_size or (only and name not in only):
            continue
        t0 = time.perf_counter()
        base = (*TRAIN, *HF_ARGS[name]()) if name in HF_ARGS else BASE
        outcome = localize_config(
            [*base, *args], steps=2, dims_cache=dims_cache, around_layout=lambda: planted(gate, mutation)
        )
        results[name] = {
            "code": outcome.code,
            "text": outcome.text,
            "first": outcome.first,
            "hint": outcome.hint,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        if rank == 0:
            print(
                f"[localize ws={world_size}] {name}: {outcome.text.splitlines()[0]} ({results[name]['seconds']} s)",
                flush=True,
            )
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


def main() -> int:
    from dist_utils import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    return spawn(rank_main, a.world_size, a.out, [s for s in a.only.split(",") if s] or None, timeout_s=60.0)


if __name__ == "__main__":
    sys.exit(main())
