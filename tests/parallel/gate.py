"""The equality gate: every parallel layout trains exactly like one device (float64, <= 1e-10).

Run once per world size (``python tests/parallel/gate.py --world-size 4 --out gate4.json``; the test
``test_parallel_gate.py`` does it for 2, 4 and 8). One process group runs the whole matrix of that world size:
for each :class:`Layout` every rank builds the same seeded tiny model in float64, trains a copy on one
"device" (in-process, on the full global batches) and a copy parallelized by the layout on its slice of the
same batches, with the real ``train_step`` (AdamW, clipping that acts, 3 different global batches), and
compares after every step: loss, gradient norm, every gradient and every weight (each rank its shards against
the same cut of the one-device tensor: :func:`_diff`; the max over the ranks is the max over the full tensor).

Mutations (:data:`MUTATIONS`) plant a known bug for the duration of one layout; the gate must then fail,
and ``test_parallel_gate.py`` asserts that it does.

Extending: a layout kind is a builder in :data:`BUILDERS` that turns ``(layout, cfg, ctx)`` into a
:class:`Built` (model parts, optimizer, loss, ``train_step`` keyword arguments, how to cut a global batch into
this rank's micro-batches). The comparison, the reference, the mutations and the reporting are shared. A
pipeline layout adds ``BUILDERS["pp"]`` and ``Layout(..., kind="pp")`` entries; parameters a rank does not
hold are simply not compared there (the coverage check asserts that some rank compared each of them).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_models import HF_CONFIGS, hf_folder  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters as dynamo_counters  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from titanlike.config import JobConfig, load_config, model_args_from_config  # noqa: E402
from titanlike.loss import IGNORE_INDEX, ScaledLoss
from titanlike.models import get_spec  # noqa: E402
from titanlike.parallel.clip import plain_clip_grad_norm_
from titanlike.parallel.ties import tie_groups
from titanlike.training.optim import build_optimizer  # noqa: E402
from titanlike.training.step import train_step  # noqa: E402

TOL = 1e-10
STEPS = 3
BROKEN = 1e-6  # a mutation must move its metric by at least this much (test_parallel_gate.py, test_pipeline_gate.py)
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 128
# Shared by every layout and the reference: float64, AdamW, clipping with a small max_norm (it acts every step).
# The model shape (MODEL_ARGS) for the titanlike models; the transformers models (HF_MODELS) take theirs from
# their config.json.
MODEL_ARGS = ("--model.flavor", "tiny", "--model.dim", "64", "--model.max_seq_len", str(SEQ))
TRAIN_ARGS = (
    "--training.seq_len",
    str(SEQ),
    "--training.dtype",
    "float64",
    "--training.max_norm",
    "0.05",
    "--training.global_batch_size",
    str(GLOBAL_BATCH),
    "--optimizer.lr",
    "0.01",
    "--optimizer.weight_decay",
    "0.1",
)
BASE_ARGS = (*MODEL_ARGS, *TRAIN_ARGS)

# transformers models (model.name = "hf", tests/parallel/hf_models.py): small float64 configs written by the gate
# (no downloads), the library's own modules under every layout. Phi-3: fused q|k|v (grouped: unequal chunks) and
# gate|up, its attention slicing with the config's head counts; Qwen3: per-head q/k norms; Qwen2: q/k/v biases and
# tied embeddings. Their RMSNorms compute in float32 inside the float64 model (transformers' code).
HF_MODELS = {key: ("--model.name", "hf", "--model.hf_config", hf_folder(key)) for key in HF_CONFIGS}
# Model shapes: tiny = dim 64, 2 layers, 4 heads, 2 kv heads (GQA), SwiGLU 176, vocab 128.
MODELS = {
    "gqa": (),
    "gqa8": ("--model.n_heads", "8", "--model.n_kv_heads", "4"),  # tp 4 divides the kv heads
    "tied": ("--model.tie_embeddings", "true"),
    # GPT-2 (tiny: dim 64, 2 layers, 4 heads, fused c_attn with bias, LayerNorm with bias, GELU 256, learned
    # positions, tied embeddings).
    "gpt2": ("--model.name", "gpt2"),
    "gpt2_untied": ("--model.name", "gpt2", "--model.tie_embeddings", "false"),
    # Qwen3 (tiny: dim 64, 2 layers, 4 heads of 32 (q 128 wide, not dim), 2 kv heads, per-head q/k RMSNorm, SwiGLU
    # 96, rotate-half RoPE, tied embeddings as the small sizes).
    "qwen3": ("--model.name", "qwen3"),
    "qwen3_untied": ("--model.name", "qwen3", "--model.tie_embeddings", "false"),
    # Qwen3-MoE (tiny: Qwen3's attention, both layers MoE of 8 experts of 32, top-2 renormalised, the expert-bias
    # update (0.05) and the sequence-wise aux loss (0.01) on): the biases are compared after every step too.
    "moe": ("--model.name", "qwen3_moe"),
    # Muon on the block matrices (AdamW for the rest), Newton-Schulz in float64 (any rounding difference shows);
    # muon_bf16: torch's bfloat16 Newton-Schulz; muon_small_buckets: buckets of one matrix per rank (several
    # all-to-all pairs), plain momentum; muon_gpt2: fused c_attn orthogonalized per chunk, Moonshot's lr adjustment.
    "muon": ("--optimizer.name", "Muon", "--optimizer.ns_dtype", "float64"),
    "muon_bf16": ("--optimizer.name", "Muon"),
    "muon_small_buckets": (
        "--optimizer.name",
        "Muon",
        "--optimizer.ns_dtype",
        "float64",
        "--optimizer.muon_bucket_mb",
        "0",
        "--optimizer.nesterov",
        "false",
    ),
    "muon_gpt2": (
        "--model.name",
        "gpt2",
        "--optimizer.name",
        "Muon",
        "--optimizer.ns_dtype",
        "float64",
        "--optimizer.adjust_lr_fn",
        "match_rms_adamw",
    ),
    # Document masking (block_causal): packed documents (EOS planted, global_batch(documents=True)), positions
    # restarting at every document start, or not.
    "block": ("--model.attn_mask_type", "block_causal"),
    "block_reset": ("--model.attn_mask_type", "block_causal", "--model.reset_position_ids", "true"),
    "gpt2_block_reset": (
        "--model.name",
        "gpt2",
        "--model.attn_mask_type",
        "block_causal",
        "--model.reset_position_ids",
        "true",
    ),
    # gpt-oss (tiny: a sliding-window layer (window 4 of the 16 positions) and a full one, sinks, q/k/v/o biases,
    # YaRN, 4 biased experts top-2 with the clamped SwiGLU (limit 0.1, so it acts)), causal and block_causal
    "gpt_oss": ("--model.name", "gpt_oss"),
    "gpt_oss_block": ("--model.name", "gpt_oss", "--model.attn_mask_type", "block_causal"),
    # a window wider than a cp chunk (6 - 1 > 16 / 4): cp gathers every key and masks
    "gpt_oss_wide": ("--model.name", "gpt_oss", "--model.sliding_window", "6"),
    # a window of 2 (one chunk at cp 4): the ring's windowed layer needs steps 0, 1 and 3 only (step 2 not sent)
    "gpt_oss_narrow": ("--model.name", "gpt_oss", "--model.sliding_window", "2"),
    # DeepSeek-V3 (tiny: dim 64, MLA with the q low-rank path (4 heads, latent 32 + shared RoPE key 8, nope 16,
    # v 16), a dense first layer then MoE (8 experts, sigmoid + the correction-bias update, 4 groups / top-2, route
    # scale 2.5, one shared expert), one MTP depth (its block MoE) weighted 0.3): lite = a plain query projection and
    # rotate-half RoPE
    "ds": ("--model.name", "deepseek_v3"),
    "ds_lite": ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_lite", "--model.n_layers", "2"),
    "ds_block": ("--model.name", "deepseek_v3", "--model.attn_mask_type", "block_causal"),
    # context parallelism without MTP (the latent + RoPE key gathered, expanded locally:
    # ContextParallelLatentAttention); with MTP: the "ds" layouts under cp
    "ds_cp": ("--model.name", "deepseek_v3", "--model.mtp_layers", "0"),
    "ds_cp_block": ("--model.name", "deepseek_v3", "--model.mtp_layers", "0", "--model.attn_mask_type", "block_causal"),
    # Qwen3-Next (tiny: a Gated DeltaNet layer (2 key heads of 8, 4 value heads of 8, conv 4, chunk 4) then a gated
    # attention one (4 heads of 16, 2 kv heads, RoPE on half of each head), MoE of 4 experts of 32, top-2, with the
    # sigmoid-gated shared expert; no expert bias, as transformers' model); qnext_block: packed documents
    "qnext": ("--model.name", "qwen3_next"),
    "qnext_block": ("--model.name", "qwen3_next", "--model.attn_mask_type", "block_causal"),
    **HF_MODELS,
}
# Matrices Muon orthogonalizes per model (tiny, 2 blocks): Llama 7 per block; GPT-2 c_attn's q, k, v + 3.
MUON_MATRICES = {"muon": 14, "muon_bf16": 14, "muon_small_buckets": 14, "muon_gpt2": 12}


@dataclass(frozen=True)
class Layout:
    name: str
    world_size: int
    args: tuple[str, ...] = ()  # command-line overrides (parallel degrees, batch size, ...)
    model: str = "gqa"  # key of MODELS
    kind: str = "spmd"  # key of BUILDERS
    mutation: str | None = None  # key of MUTATIONS: the gate must fail
    # How the parallel model gets its initial weights: "sharded" (the trainer's fresh start: built on meta,
    # parallelized, each rank fills its shards with the sharded init, which must equal the single-device init
    # exactly), "checkpoint" (built on meta, shards allocated, the full weights loaded as from a checkpoint) or
    # "materialised" (a seeded full model on every rank, parallelized: the path of a user's own module)
    init: str = "sharded"


def _tp(n, *more):
    return ("--parallelism.tensor_parallel_degree", str(n), *more)


def _cp(n, *more):
    return ("--parallelism.context_parallel_degree", str(n), *more)


def _a2a(n, *more):
    """Context parallelism by all-to-all over heads (Ulysses: parallelism.context_parallel_method alltoall)."""
    return _cp(n, "--parallelism.context_parallel_method", "alltoall", *more)


def _ring(n, *more):
    """Context parallelism by a ring of key / value blocks (parallelism.context_parallel_method ring)."""
    return _cp(n, "--parallelism.context_parallel_method", "ring", *more)


CP_METHODS = (("a2a", _a2a), ("ring", _ring))


def _hybrid(n, a2a, *more):
    """Context parallelism by all-to-all inside groups of ``a2a`` cp ranks, a ring across the groups
    (parallelism.context_parallel_method hybrid)."""
    return _cp(
        n,
        "--parallelism.context_parallel_method",
        "hybrid",
        "--parallelism.context_parallel_a2a_degree",
        str(a2a),
        *more,
    )


def _ep(n, *more):
    return ("--parallelism.expert_parallel_degree", str(n), *more)


def _padded(*more):
    """The padded expert dispatch (static shapes, no host read: parallelism.expert_dispatch padded)."""
    return ("--parallelism.expert_dispatch", "padded", *more)


SP = ("--parallelism.enable_sequence_parallel", "true")
ZERO1 = ("--parallelism.distributed_optimizer", "true")
CPU_OFFLOAD = ("--training.enable_cpu_offload", "true")
ACT_OFFLOAD = ("--activation_checkpoint.offload", "true")
AC_EVERY_2 = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")
NO_LP = ("--parallelism.disable_loss_parallel", "true")


def _dp(replicate, shard, local_batch):
    return (
        "--parallelism.data_parallel_replicate_degree",
        str(replicate),
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        "--training.local_batch_size",
        str(local_batch),
    )


COMPILED = ("--compile.enable", "true", "--compile.backend", "aot_eager")
COMPILED_LAYOUTS = (
    ("tp2_sp", _tp(2, *SP, *_dp(1, 1, 8)), "gqa"),
    ("fsdp2", _dp(1, 2, 4), "gqa"),
    ("cp2", _cp(2, *_dp(1, 1, 8)), "gqa"),
    # MoE under ep: both dispatches (fewer graph breaks with the padded one, test_parallel_gate.py's COMPILE_BREAKS);
    # MoE under fsdp 2 without ep: pipeline_gate.py's "compile moe pp2 fsdp2 1F1B"
    ("moe tp2_sp_ep2", _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))), "moe"),
    ("moe tp2_sp_ep2 padded", _padded(*_ep(2, *_tp(2, *SP, *_dp(1, 1, 8)))), "moe"),
)
# 4 ranks: every other family's blocks under cp 2 x tp 2 + SP (x ep 2 where the blocks hold experts) in one layout
# (their fsdp 2 and pp 2: tests/parallel/pipeline_gate.py's compiled pp 2 x fsdp 2 layouts)
COMPILED_FAMILIES = (
    ("gpt2", "gpt2", False),
    ("qwen3", "qwen3", False),
    ("moe", "moe", True),
    ("gpt_oss", "gpt_oss", True),
    ("ds", "ds", True),
    ("qnext", "qnext", True),
)
COMPILED_LAYOUTS_4 = tuple(
    (f"{name} cp2_tp2_sp{'_ep2' if ep else ''}", (_ep(2) if ep else ()) + _cp(2, *_tp(2, *SP, *_dp(1, 1, 8))), model)
    for name, model, ep in COMPILED_FAMILIES
)
# the other context-parallel methods compiled (the ring's point-to-point exchange an opaque custom op in the graph,
# titanlike/parallel/p2p.py; the all-to-all's whole-sequence document mask and window built inside the block):
# (name, world size, args, model), each in its world size's launch
CP_COMPILED_LAYOUTS = (
    ("a2a gpt_oss_block cp2", 2, _a2a(2, *_dp(1, 1, 8)), "gpt_oss_block"),
    ("ring cp2", 2, _ring(2, *_dp(1, 1, 8)), "gqa"),
    ("hybrid cp4_a2a2", 4, _hybrid(4, 2, *_dp(1, 1, 8)), "gqa"),
)

LAYOUTS = [
    # 2 ranks
    Layout("tp2", 2, _tp(2, *_dp(1, 1, 8))),
    Layout("tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8))),
    Layout("tp2_no_loss_parallel", 2, _tp(2, *NO_LP, *_dp(1, 1, 8))),
    Layout("tp2_sp_no_loss_parallel", 2, _tp(2, *SP, *NO_LP, *_dp(1, 1, 8))),
    Layout("tp2_materialised", 2, _tp(2, *_dp(1, 1, 8)), init="materialised"),
    Layout("tp2_sp_loss_chunks", 2, _tp(2, *SP, "--parallelism.loss_chunk_size", "48", *_dp(1, 1, 8))),
    Layout("tp2_tied", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="tied"),
    Layout("tp2_meta", 2, _tp(2, *_dp(1, 1, 8)), init="checkpoint"),
    Layout("tp2_sp_accum2", 2, _tp(2, *SP, *_dp(1, 1, 4))),
    Layout("fsdp2", 2, _dp(1, 2, 4)),
    Layout("fsdp2_accum2", 2, _dp(1, 2, 2)),
    Layout("fsdp2_tied", 2, _dp(1, 2, 4), model="tied"),
    Layout("fsdp2_reshard_never", 2, ("--parallelism.fsdp_reshard_after_forward", "never", *_dp(1, 2, 4))),
    Layout("ddp2", 2, _dp(2, 1, 4)),
    Layout("ddp2_zero1", 2, (*ZERO1, *_dp(2, 1, 4))),
    Layout("ddp2_zero1_accum2", 2, (*ZERO1, *_dp(2, 1, 2))),
    Layout("MUT ddp2_zero1 shards not all-gathered", 2, (*ZERO1, *_dp(2, 1, 4)), mutation="zero1_not_all_gathered"),
    Layout("fsdp2_cpu_offload", 2, (*CPU_OFFLOAD, *_dp(1, 2, 4))),
    Layout("ddp2_cpu_offload_accum2", 2, (*CPU_OFFLOAD, *_dp(2, 1, 2))),
    Layout("fsdp2_act_offload", 2, (*ACT_OFFLOAD, *_dp(1, 2, 4))),
    Layout("fsdp2_act_offload_ac_every2", 2, (*ACT_OFFLOAD, *AC_EVERY_2, *_dp(1, 2, 2))),
    Layout(
        "MUT fsdp2 offload stale device copy",
        2,
        (*CPU_OFFLOAD, *_dp(1, 2, 4)),
        mutation="cpu_offload_stale_device_copy",
    ),
    Layout("MUT fsdp2 act offload stale tensor", 2, (*ACT_OFFLOAD, *_dp(1, 2, 4)), mutation="act_offload_stale"),
    Layout("tp2_sp_ac_selective_op", 2, _tp(2, *SP, "--activation_checkpoint.mode", "selective", *_dp(1, 1, 8))),
    Layout("MUT tp2 no f backward all-reduce", 2, _tp(2, *_dp(1, 1, 8)), mutation="tp_no_backward_reduce"),
    Layout("MUT tp2_sp no f backward reduce-scatter", 2, _tp(2, *SP, *_dp(1, 1, 8)), mutation="tp_no_backward_reduce"),
    Layout("MUT tp2 CE without max all-reduce", 2, _tp(2, *_dp(1, 1, 8)), mutation="ce_no_max_all_reduce"),
    Layout("MUT tp2_sp norms not sequence-parallel", 2, _tp(2, *SP, *_dp(1, 1, 8)), mutation="sp_norm_plain"),
    Layout("MUT fsdp2 loss averaged per rank", 2, _dp(1, 2, 4), mutation="loss_mean_per_rank"),
    Layout("MUT fsdp2 gradients averaged", 2, _dp(1, 2, 4), mutation="fsdp_average"),
    Layout("gpt2 tp2", 2, _tp(2, *_dp(1, 1, 8)), model="gpt2"),
    Layout("gpt2 tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="gpt2"),
    Layout("gpt2 tp2_sp untied no loss parallel", 2, _tp(2, *SP, *NO_LP, *_dp(1, 1, 8)), model="gpt2_untied"),
    Layout("gpt2 fsdp2", 2, _dp(1, 2, 4), model="gpt2"),
    Layout(
        "MUT gpt2 tp2 c_attn plain ColwiseParallel",
        2,
        _tp(2, *_dp(1, 1, 8)),
        model="gpt2",
        mutation="fused_plain_colwise",
    ),
    Layout(
        "MUT gpt2 tp2_sp no f backward reduce-scatter",
        2,
        _tp(2, *SP, *_dp(1, 1, 8)),
        model="gpt2",
        mutation="tp_no_backward_reduce",
    ),
    Layout(
        "MUT tp2_sp to_empty drops the gradient hooks",
        2,
        _tp(2, *SP, *_dp(1, 1, 8)),
        mutation="to_empty_drops_grad_hooks",
    ),
    Layout("MUT fsdp2 init ignores the shards", 2, _dp(1, 2, 4), mutation="init_ignores_shards"),
    Layout(
        "MUT gpt2 tp2 init of fused c_attn as a plain shard",
        2,
        _tp(2, *_dp(1, 1, 8)),
        model="gpt2",
        mutation="init_strided_as_shard",
    ),
    Layout("MUT fsdp2 validation leaves FSDP unsharded", 2, _dp(1, 2, 4), mutation="eval_keeps_unsharded"),
    Layout("cp2", 2, _cp(2, *_dp(1, 1, 8))),
    Layout("cp2_tied_accum2", 2, _cp(2, *_dp(1, 1, 4)), model="tied"),
    Layout("cp2_ac_full", 2, _cp(2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8))),
    Layout("cp2_ac_selective_op", 2, _cp(2, "--activation_checkpoint.mode", "selective", *_dp(1, 1, 8))),
    Layout("MUT cp2 K/V grads not reduce-scattered", 2, _cp(2, *_dp(1, 1, 8)), mutation="cp_kv_grad_not_reduced"),
    Layout("MUT cp2 chunks in wrong order", 2, _cp(2, *_dp(1, 1, 8)), mutation="cp_chunks_wrong_order"),
    Layout("MUT cp2 RoPE local positions", 2, _cp(2, *_dp(1, 1, 8)), mutation="cp_rope_local"),
    Layout("MUT cp2 loss tokens per cp rank", 2, _cp(2, *_dp(1, 1, 8)), mutation="cp_tokens_per_rank"),
    Layout("qwen3 tp2", 2, _tp(2, *_dp(1, 1, 8)), model="qwen3"),
    Layout("qwen3 tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="qwen3"),
    Layout("qwen3 fsdp2", 2, _dp(1, 2, 4), model="qwen3"),
    Layout("qwen3 cp2", 2, _cp(2, *_dp(1, 1, 8)), model="qwen3"),
    Layout(
        "MUT qwen3 tp2_sp q/k norms ReplicateParallel",
        2,
        _tp(2, *SP, *_dp(1, 1, 8)),
        model="qwen3",
        mutation="qk_norm_replicated",
    ),
    # GPT-2 under cp through the shared seams: attention (fused c_attn) and its learned positions
    Layout("gpt2 cp2", 2, _cp(2, *_dp(1, 1, 8)), model="gpt2"),
    Layout("MUT gpt2 cp2 positions local", 2, _cp(2, *_dp(1, 1, 8)), model="gpt2", mutation="cp_rope_local"),
    # Muon: every matrix orthogonalized whole, once, by its owner rank
    Layout("muon fsdp2", 2, _dp(1, 2, 4), model="muon"),
    Layout("muon tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="muon"),
    Layout("muon cp2", 2, _cp(2, *_dp(1, 1, 8)), model="muon"),
    Layout("muon gpt2 tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="muon_gpt2"),
    Layout("MUT muon fsdp2 Newton-Schulz on the local shard", 2, _dp(1, 2, 4), model="muon", mutation="muon_local_ns"),
    Layout(
        "MUT muon gpt2 tp2 c_attn orthogonalized as one matrix",
        2,
        _tp(2, *_dp(1, 1, 8)),
        model="muon_gpt2",
        mutation="muon_fused_one_matrix",
    ),
    Layout(
        "MUT muon tp2 owner's result not scattered",
        2,
        _tp(2, *_dp(1, 1, 8)),
        model="muon",
        mutation="muon_not_scattered",
    ),
    # Document masking: block_causal under every SPMD layout kind (the pipeline schedules: pipeline_gate.py; Llama
    # under TP + SP: cp2_tp2_sp at 4 ranks)
    Layout("block fsdp2", 2, _dp(1, 2, 4), model="block_reset"),
    Layout("block cp2", 2, _cp(2, *_dp(1, 1, 8)), model="block_reset"),
    Layout(
        "block cp2 no reset ac_full", 2, _cp(2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8)), model="block"
    ),
    Layout("gpt2 block cp2", 2, _cp(2, *_dp(1, 1, 8)), model="gpt2_block_reset"),
    Layout("gpt2 block tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="gpt2_block_reset"),
    Layout("MUT block cp2 rank 1 ignores documents", 2, _cp(2, *_dp(1, 1, 8)), model="block", mutation="mask_cp_rank"),
    # (GPT-2: learned positions; under RoPE the reset changes nothing but rounding, attention being relative)
    Layout(
        "MUT gpt2 block fsdp2 positions not reset", 2, _dp(1, 2, 4), model="gpt2_block_reset", mutation="mask_no_reset"
    ),
    # Qwen3-MoE: experts split over ep (borrowed from dp_shard or cp), the trainer's bias update and aux loss
    Layout("moe fsdp2", 2, _dp(1, 2, 4), model="moe"),
    Layout("moe ep2", 2, _ep(2, *_dp(1, 2, 4)), model="moe"),
    Layout("moe cp2_ep2", 2, _ep(2, *_cp(2, *_dp(1, 1, 8))), model="moe"),
    # AC: under op-level selective AC the all-to-alls are saved (5 per MoE layer, as without AC), under full AC the
    # forward's 3 run again in the recomputation (8)
    Layout(
        "moe ep2 ac_selective_op", 2, _ep(2, "--activation_checkpoint.mode", "selective", *_dp(1, 2, 4)), model="moe"
    ),
    Layout("moe ep2 ac_full", 2, _ep(2, "--activation_checkpoint.mode", "full", *_dp(1, 2, 4)), model="moe"),
    # tp2 + SP: each tp rank routes its own part of the sequence, ep borrows the tp ranks
    Layout("moe tp2_sp_ep2", 2, _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="moe"),
    Layout("moe tp2_sp_ep2 padded", 2, _padded(*_ep(2, *_tp(2, *SP, *_dp(1, 1, 8)))), model="moe"),
    # compiled blocks (fullgraph, backend aot_eager: dynamo's capture, AOT autograd's joint graph and partition; no
    # code generation, whose breaks and recompiles are decided by dynamo alike): equal to one device, and
    # test_parallel_gate.py asserts the graph breaks and that nothing compiles after the second step
    *(Layout(f"compile {name}", 2, (*args, *COMPILED), model=model) for name, args, model in COMPILED_LAYOUTS),
    *(
        Layout(f"compile {name}", world, (*args, *COMPILED), model=model)
        for name, world, args, model in CP_COMPILED_LAYOUTS
    ),
    Layout(
        "MUT moe tp2_sp_ep2 router not summed over tp",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="moe",
        mutation="moe_router_not_over_tp",
    ),
    Layout(
        "MUT moe tp2_sp_ep2 aux counts not over tp",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="moe",
        mutation="moe_aux_counts_not_over_tp",
    ),
    Layout(
        "MUT moe ep2 bias update from local loads", 2, _ep(2, *_dp(1, 2, 4)), model="moe", mutation="moe_local_loads"
    ),
    Layout("MUT moe ep2 aux loss per rank", 2, _ep(2, *_dp(1, 2, 4)), model="moe", mutation="moe_aux_per_rank"),
    # DeepSeek-V3: MLA's latent projections replicated in the attention region (gradients summed over tp), MoE as
    # qwen3_moe (ep borrowing dp_shard, or tp under SP), MTP on
    Layout("ds fsdp2", 2, _dp(1, 2, 4), model="ds"),
    Layout("ds ep2", 2, _ep(2, *_dp(1, 2, 4)), model="ds"),
    Layout("ds ep2 padded", 2, _padded(*_ep(2, *_dp(1, 2, 4))), model="ds"),
    Layout("ds tp2_sp_ep2", 2, _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="ds"),
    Layout("ds_lite tp2_sp_ep2", 2, _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="ds_lite"),
    Layout("ds_block tp2_sp_ep2", 2, _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="ds_block"),
    Layout("ds_block ep2", 2, _ep(2, *_dp(1, 2, 4)), model="ds_block"),
    Layout("ds_cp cp2_ep2", 2, _ep(2, *_cp(2, *_dp(1, 1, 8))), model="ds_cp"),
    Layout("ds cp2_ep2", 2, _ep(2, *_cp(2, *_dp(1, 1, 8))), model="ds"),  # MTP: the window's ids gathered
    Layout("ds_block cp2", 2, _cp(2, *_dp(1, 1, 8)), model="ds_block"),
    Layout(
        "MUT ds cp2 MTP labels shifted per rank", 2, _cp(2, *_dp(1, 1, 8)), model="ds", mutation="ds_cp_local_shift"
    ),
    Layout("ds_cp_block cp2", 2, _cp(2, *_dp(1, 1, 8)), model="ds_cp_block"),
    Layout(
        "MUT ds_cp cp2 latent without the RoPE key",
        2,
        _cp(2, *_dp(1, 1, 8)),
        model="ds_cp",
        mutation="ds_cp_latent_no_rope",
    ),
    Layout("MUT ds fsdp2 RoPE on the non-rope part", 2, _dp(1, 2, 4), model="ds", mutation="ds_rope_on_nope"),
    Layout(
        "MUT ds ep2 correction bias in the weights", 2, _ep(2, *_dp(1, 2, 4)), model="ds", mutation="ds_bias_in_weights"
    ),
    Layout("MUT ds ep2 group limiting skipped", 2, _ep(2, *_dp(1, 2, 4)), model="ds", mutation="ds_no_group_limit"),
    Layout("MUT ds fsdp2 MTP targets shifted by one", 2, _dp(1, 2, 4), model="ds", mutation="ds_mtp_shift"),
    Layout("MUT ds fsdp2 latent norm before the split", 2, _dp(1, 2, 4), model="ds", mutation="ds_latent_norm_unsplit"),
    Layout(
        "MUT ds tp2_sp_ep2 latent norm gradient not summed",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="ds",
        mutation="ds_latent_replicated",
    ),
    Layout(
        "MUT ds tp2_sp_ep2 MTP eh_proj gradient not summed",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="ds",
        mutation="ds_stream_linear_unsummed",
    ),
    # transformers models (model.name = "hf"): the plan translated from each config's base_model_tp_plan
    *[
        Layout(f"{m} {name}", 2, args, model=m)
        for m in HF_CONFIGS
        if m != "hf_phi3_mha"
        for name, args in (("tp2_sp", _tp(2, *SP, *_dp(1, 1, 8))), ("fsdp2", _dp(1, 2, 4)))
    ],
    Layout("hf_phi3_mha tp2_sp", 2, _tp(2, *SP, *_dp(1, 1, 8)), model="hf_phi3_mha"),
    Layout(
        "hf_qwen2_tied tp2_ac_full",
        2,
        _tp(2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8)),
        model="hf_qwen2_tied",
    ),
    Layout(
        "MUT hf_phi3_mha tp2 qkv_proj plain ColwiseParallel",
        2,
        _tp(2, *_dp(1, 1, 8)),
        model="hf_phi3_mha",
        mutation="fused_plain_colwise",
    ),
    Layout(
        "MUT hf_qwen3 tp2_sp q/k norms ReplicateParallel",
        2,
        _tp(2, *SP, *_dp(1, 1, 8)),
        model="hf_qwen3",
        mutation="qk_norm_replicated",
    ),
    Layout(
        "MUT hf_qwen2_tied tp2_sp no f backward reduce-scatter",
        2,
        _tp(2, *SP, *_dp(1, 1, 8)),
        model="hf_qwen2_tied",
        mutation="tp_no_backward_reduce",
    ),
    # gpt-oss: the window and the sinks under every SPMD layout kind (tp + SP needs ep for the experts: rule moe_tp;
    # cp2's windowed layer gathers only the last 3 keys / values of each chunk), causal and block_causal
    *[
        Layout(f"{m} {name}", 2, args, model=m)
        for m in ("gpt_oss", "gpt_oss_block")
        for name, args in (
            ("tp2_sp_ep2", _ep(2, *_tp(2, *SP, *_dp(1, 1, 8)))),
            ("fsdp2", _dp(1, 2, 4)),
            ("cp2", _cp(2, *_dp(1, 1, 8))),
            ("ep2", _ep(2, *_dp(1, 2, 4))),
        )
    ],
    Layout("gpt_oss_wide cp2", 2, _cp(2, *_dp(1, 1, 8)), model="gpt_oss_wide"),
    Layout("gpt_oss cp2 ac_full", 2, _cp(2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8)), model="gpt_oss"),
    Layout(
        "gpt_oss_block ep2 ac_selective_op",
        2,
        _ep(2, "--activation_checkpoint.mode", "selective", *_dp(1, 2, 4)),
        model="gpt_oss_block",
    ),
    Layout("MUT gpt_oss fsdp2 window off by one", 2, _dp(1, 2, 4), model="gpt_oss", mutation="window_off_by_one"),
    Layout(
        "MUT gpt_oss cp2 window on local positions", 2, _cp(2, *_dp(1, 1, 8)), model="gpt_oss", mutation="window_local"
    ),
    Layout(
        "MUT gpt_oss_block cp2 sinks dropped", 2, _cp(2, *_dp(1, 1, 8)), model="gpt_oss_block", mutation="sinks_dropped"
    ),
    Layout(
        "MUT gpt_oss tp2_sp_ep2 sinks not split with their heads",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="gpt_oss",
        mutation="sinks_not_split",
    ),
    Layout(
        "MUT hf_mistral_window fsdp2 window dropped",
        2,
        _dp(1, 2, 4),
        model="hf_mistral_window",
        mutation="hf_window_dropped",
    ),
    Layout("MUT gpt_oss ep2 clamp missing", 2, _ep(2, *_dp(1, 2, 4)), model="gpt_oss", mutation="clamp_missing"),
    # Qwen3-Next: the linear-attention layer's cp by state passing, its heads over tp (ep borrows the tp ranks)
    *[
        Layout(f"{m} {name}", 2, args, model=m)
        for m in ("qnext", "qnext_block")
        for name, args in (
            ("cp2", _cp(2, *_dp(1, 1, 8))),
            ("tp2_sp_ep2", _ep(2, *_tp(2, *SP, *_dp(1, 1, 8)))),
            ("fsdp2", _dp(1, 2, 4)),
            ("ep2", _ep(2, *_dp(1, 2, 4))),
        )
    ],
    Layout("qnext cp2 ac_full", 2, _cp(2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8)), model="qnext"),
    Layout(
        "qnext_block cp2 ac_selective_op",
        2,
        _cp(2, "--activation_checkpoint.mode", "selective", *_dp(1, 1, 8)),
        model="qnext_block",
    ),
    Layout("MUT qnext cp2 state not passed", 2, _cp(2, *_dp(1, 1, 8)), model="qnext", mutation="cp_state_not_passed"),
    Layout(
        "MUT qnext cp2 scan in placement order", 2, _cp(2, *_dp(1, 1, 8)), model="qnext", mutation="cp_scan_rank_order"
    ),
    Layout("MUT qnext cp2 conv halo missing", 2, _cp(2, *_dp(1, 1, 8)), model="qnext", mutation="cp_no_conv_halo"),
    # context parallelism by all-to-all over heads (Ulysses) and by a ring of key / value blocks: every attention kind
    # through the seam (causal, documents, window + sinks, MLA's expanded heads, Gated DeltaNet's state passing
    # beside gated attention)
    *[
        Layout(f"{meth} {m + ' ' if m != 'gqa' else ''}cp2", 2, cp_of(2, *_dp(1, 1, 8)), model=m)
        for meth, cp_of in CP_METHODS
        for m in ("gqa", "block_reset", "gpt_oss", "gpt_oss_block", "ds_cp", "ds_cp_block", "qnext")
    ],
    *[
        Layout(f"{meth} cp2 ac_{ac}", 2, cp_of(2, "--activation_checkpoint.mode", mode, *_dp(1, 1, 8)))
        for meth, cp_of in CP_METHODS
        for ac, mode in (("full", "full"), ("selective_op", "selective"))
    ],
    Layout(
        "MUT a2a cp2 heads scattered back in the wrong order", 2, _a2a(2, *_dp(1, 1, 8)), mutation="a2a_heads_order"
    ),
    Layout("MUT a2a cp2 chunks not put back in order", 2, _a2a(2, *_dp(1, 1, 8)), mutation="cp_chunks_wrong_order"),
    Layout("MUT a2a cp2 reverse all-to-all skipped in backward", 2, _a2a(2, *_dp(1, 1, 8)), mutation="a2a_no_grad"),
    Layout("MUT ring cp2 a ring step skipped", 2, _ring(2, *_dp(1, 1, 8)), mutation="ring_step_skipped"),
    Layout("MUT ring cp2 log-sum-exps merged by max", 2, _ring(2, *_dp(1, 1, 8)), mutation="ring_merge_max"),
    Layout("MUT ring cp2 dK / dV not passed home", 2, _ring(2, *_dp(1, 1, 8)), mutation="ring_grads_kept"),
    Layout(
        "MUT ring gpt_oss cp2 a window step skipped",
        2,
        _ring(2, *_dp(1, 1, 8)),
        model="gpt_oss",
        mutation="ring_window_step_skipped",
    ),
    Layout(
        "MUT ring ds_cp cp2 visiting up-projection grads dropped",
        2,
        _ring(2, *_dp(1, 1, 8)),
        model="ds_cp",
        mutation="ring_latent_weight_dropped",
    ),
    Layout(
        "MUT ring gpt_oss_block cp2 sinks dropped",
        2,
        _ring(2, *_dp(1, 1, 8)),
        model="gpt_oss_block",
        mutation="ring_no_sinks",
    ),
    Layout(
        "MUT a2a gpt_oss cp2 every rank uses the first heads' sinks",
        2,
        _a2a(2, *_dp(1, 1, 8)),
        model="gpt_oss",
        mutation="a2a_sinks_heads",
    ),
    Layout(
        "MUT qnext_block cp2 state not reset at a document start",
        2,
        _cp(2, *_dp(1, 1, 8)),
        model="qnext_block",
        mutation="delta_no_reset",
    ),
    Layout("MUT qnext fsdp2 decay sign flipped", 2, _dp(1, 2, 4), model="qnext", mutation="delta_decay_sign"),
    Layout("MUT qnext fsdp2 beta not a sigmoid", 2, _dp(1, 2, 4), model="qnext", mutation="delta_beta_raw"),
    Layout(
        "MUT qnext ep2 shared-expert gate missing", 2, _ep(2, *_dp(1, 2, 4)), model="qnext", mutation="no_shared_gate"
    ),
    Layout(
        "MUT qnext tp2_sp_ep2 delta norm ReplicateParallel",
        2,
        _ep(2, *_tp(2, *SP, *_dp(1, 1, 8))),
        model="qnext",
        mutation="qk_norm_replicated",
    ),
    # 4 ranks
    Layout("tp4_gqa", 4, _tp(4, *_dp(1, 1, 8)), model="gqa8"),
    Layout("fsdp4", 4, _dp(1, 4, 2)),
    Layout("hsdp2x2", 4, _dp(2, 2, 2)),
    Layout("tp2_fsdp2", 4, _tp(2, *_dp(1, 2, 4))),
    Layout("tp2_sp_fsdp2", 4, _tp(2, *SP, *_dp(1, 2, 4))),
    Layout("tp2_fsdp2_ac_full", 4, _tp(2, "--activation_checkpoint.mode", "full", *_dp(1, 2, 4))),
    Layout("tp2_sp_fsdp2_tied_accum2_meta", 4, _tp(2, *SP, *_dp(1, 2, 2)), model="tied", init="checkpoint"),
    Layout("MUT hsdp2x2 gradients averaged", 4, _dp(2, 2, 2), mutation="fsdp_average"),
    Layout("gpt2 hsdp2x2", 4, _dp(2, 2, 2), model="gpt2_untied"),
    Layout("gpt2 tp2_fsdp2", 4, _tp(2, *_dp(1, 2, 4)), model="gpt2"),
    Layout("gpt2 tp2_fsdp2 materialised", 4, _tp(2, *_dp(1, 2, 4)), model="gpt2", init="materialised"),
    Layout("gpt2 tp2_sp_fsdp2 meta", 4, _tp(2, *SP, *_dp(1, 2, 4)), model="gpt2", init="checkpoint"),
    Layout("cp4", 4, _cp(4, *_dp(1, 1, 8))),
    Layout("cp2_tp2_sp", 4, _cp(2, *_tp(2, *SP, *_dp(1, 1, 8)))),
    Layout("cp2_fsdp2", 4, _cp(2, *_dp(1, 2, 4))),
    Layout("gpt2 cp2_tp2_sp", 4, _cp(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="gpt2"),
    Layout("qwen3 hsdp2x2", 4, _dp(2, 2, 2), model="qwen3_untied"),
    Layout("qwen3 tp2_sp_fsdp2", 4, _tp(2, *SP, *_dp(1, 2, 4)), model="qwen3"),
    Layout("qwen3 cp2_tp2_sp", 4, _cp(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="qwen3"),
    Layout("block cp2_tp2_sp", 4, _cp(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="block_reset"),
    Layout("muon tp2_sp_fsdp2 small buckets", 4, _tp(2, *SP, *_dp(1, 2, 4)), model="muon_small_buckets"),
    Layout("muon hsdp2x2 bf16", 4, _dp(2, 2, 2), model="muon_bf16"),
    Layout("muon gpt2 tp2_fsdp2", 4, _tp(2, *_dp(1, 2, 4)), model="muon_gpt2"),
    Layout("moe ep2_fsdp4", 4, _ep(2, *_dp(1, 4, 2)), model="moe"),
    Layout("moe ep2_hsdp2x2", 4, _ep(2, *_dp(2, 2, 2)), model="moe"),
    Layout("moe tp2_sp_fsdp2_ep2", 4, _ep(2, *_tp(2, *SP, *_dp(1, 2, 4))), model="moe"),
    Layout("moe tp2_sp_fsdp2_ep4", 4, _ep(4, *_tp(2, *SP, *_dp(1, 2, 4))), model="moe"),
    Layout(
        "MUT moe ep2_fsdp4 expert FSDP averaging",
        4,
        _ep(2, *_dp(1, 4, 2)),
        model="moe",
        mutation="moe_expert_fsdp_average",
    ),
    Layout("ds tp2_sp_fsdp2_ep2", 4, _ep(2, *_tp(2, *SP, *_dp(1, 2, 4))), model="ds"),
    *(Layout(f"compile {name}", 4, (*args, *COMPILED), model=model) for name, args, model in COMPILED_LAYOUTS_4),
    Layout("ds_cp_block cp2_tp2_sp_ep2", 4, _ep(2, *_cp(2, *_tp(2, *SP, *_dp(1, 1, 8)))), model="ds_cp_block"),
    Layout("ds_block cp2_tp2_sp_ep2", 4, _ep(2, *_cp(2, *_tp(2, *SP, *_dp(1, 1, 8)))), model="ds_block"),
    *[Layout(f"{m} tp2_fsdp2", 4, _tp(2, *_dp(1, 2, 4)), model=m) for m in HF_CONFIGS if m != "hf_phi3_mha"],
    Layout("hf_qwen2_tied hsdp2x2", 4, _dp(2, 2, 2), model="hf_qwen2_tied"),  # HSDP, the tie across the groups
    *[
        Layout(f"{m} {name}", 4, args, model=m)
        for m in ("qnext", "qnext_block")
        for name, args in (
            ("cp4", _cp(4, *_dp(1, 1, 8))),
            ("cp2_tp2_sp_ep2", _ep(2, *_cp(2, *_tp(2, *SP, *_dp(1, 1, 8))))),
        )
    ],
    Layout(
        "MUT qnext_block cp4 scan in placement order",
        4,
        _cp(4, *_dp(1, 1, 8)),
        model="qnext_block",
        mutation="cp_scan_rank_order",
    ),
    Layout("MUT qnext cp4 conv halo missing", 4, _cp(4, *_dp(1, 1, 8)), model="qnext", mutation="cp_no_conv_halo"),
    # all-to-all over heads (Llama's 2 kv heads repeated to 4 at cp 4) and the ring at cp 4, and composed with tp +
    # SP (the all-to-all splits a tp rank's heads further over cp) and FSDP
    *[
        Layout(f"{meth} {m + ' ' if m != 'gqa' else ''}cp4", 4, cp_of(4, *_dp(1, 1, 8)), model=m)
        for meth, cp_of in CP_METHODS
        for m in ("gqa", "block_reset", "gpt_oss_block", "ds_cp")
    ],
    *[
        layout
        for meth, cp_of in CP_METHODS
        for layout in (
            Layout(f"{meth} cp2_tp2_sp", 4, cp_of(2, *_tp(2, *SP, *_dp(1, 1, 8)))),
            Layout(f"{meth} block cp2_tp2_sp", 4, cp_of(2, *_tp(2, *SP, *_dp(1, 1, 8))), model="block_reset"),
            Layout(
                f"{meth} gpt_oss cp2_tp2_sp_ep2", 4, _ep(2, *cp_of(2, *_tp(2, *SP, *_dp(1, 1, 8)))), model="gpt_oss"
            ),
            Layout(
                f"{meth} ds_cp_block cp2_tp2_sp_ep2",
                4,
                _ep(2, *cp_of(2, *_tp(2, *SP, *_dp(1, 1, 8)))),
                model="ds_cp_block",
            ),
            Layout(f"{meth} cp2_fsdp2", 4, cp_of(2, *_dp(1, 2, 4))),
        )
    ],
    Layout("MUT ring cp4 a ring step skipped", 4, _ring(4, *_dp(1, 1, 8)), mutation="ring_step_skipped"),
    # the ring's windowed layer at cp 4 with a window of one chunk: steps 0, 1 and 3 (step 2 never sent); MLA's
    # latent ring under FSDP (the up-projection's gradients of the visiting blocks reduce-scattered over dp x cp)
    Layout("ring gpt_oss_narrow cp4", 4, _ring(4, *_dp(1, 1, 8)), model="gpt_oss_narrow"),
    Layout(
        "MUT ring gpt_oss_narrow cp4 a window step skipped",
        4,
        _ring(4, *_dp(1, 1, 8)),
        model="gpt_oss_narrow",
        mutation="ring_window_step_skipped",
    ),
    Layout("ring ds_cp cp2_fsdp2", 4, _ring(2, *_dp(1, 2, 4)), model="ds_cp"),
    # hybrid: all-to-all inside groups of 2, a ring across the 2 groups (each rank holds 4 chunks of 2 of the heads)
    *[
        Layout(f"hybrid {m + ' ' if m != 'gqa' else ''}cp4_a2a2", 4, _hybrid(4, 2, *_dp(1, 1, 8)), model=m)
        for m in ("gqa", "block_reset", "gpt_oss", "gpt_oss_block", "ds_cp", "ds_cp_block", "qnext")
    ],
    Layout(
        "MUT hybrid cp4_a2a2 heads scattered back in the wrong order",
        4,
        _hybrid(4, 2, *_dp(1, 1, 8)),
        mutation="a2a_heads_order",
    ),
    Layout("hybrid cp4_a2a2 ac_full", 4, _hybrid(4, 2, "--activation_checkpoint.mode", "full", *_dp(1, 1, 8))),
    Layout("hybrid gpt_oss cp4_a2a2_ep2", 4, _ep(2, *_hybrid(4, 2, *_dp(1, 1, 8))), model="gpt_oss"),
    Layout("MUT hybrid cp4_a2a2 a ring step skipped", 4, _hybrid(4, 2, *_dp(1, 1, 8)), mutation="ring_step_skipped"),
    Layout(
        "MUT hybrid cp4_a2a2 log-sum-exps merged by max", 4, _hybrid(4, 2, *_dp(1, 1, 8)), mutation="ring_merge_max"
    ),
    Layout(
        "MUT a2a cp4 heads scattered back in the wrong order", 4, _a2a(4, *_dp(1, 1, 8)), mutation="a2a_heads_order"
    ),
    # 8 ranks
    Layout("tp2_hsdp2x2", 8, _tp(2, *_dp(2, 2, 2))),
    Layout("tp2_sp_fsdp4", 8, _tp(2, *SP, *_dp(1, 4, 2))),
    Layout("cp2_tp2_fsdp2", 8, _cp(2, *_tp(2, *_dp(1, 2, 4)))),
    Layout("hybrid cp4_a2a2_tp2_sp", 8, _hybrid(4, 2, *_tp(2, *SP, *_dp(1, 1, 8)))),
    Layout("hybrid cp4_a2a2_fsdp2", 8, _hybrid(4, 2, *_dp(1, 2, 4))),
    Layout("gpt2 tp2_sp_hsdp2x2", 8, _tp(2, *SP, *_dp(2, 2, 2)), model="gpt2"),
    Layout("ds ep4_fsdp8", 8, _ep(4, *_dp(1, 8, 1)), model="ds"),
]


# ---------------------------------------------------------------------------------------------- mutations
@contextlib.contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class _GradNotReduced(torch.autograd.Function):
    """Identity forward; backward takes each rank's partial gradient as if it were the sum (no all-reduce)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            return DTensor.from_local(
                grad.to_local(), grad.device_mesh, [Replicate()] * grad.device_mesh.ndim, run_check=False
            )
        return grad


@contextlib.contextmanager
def _tp_no_backward_reduce():
    """The f operator at the attention / feed-forward entry loses its backward all-reduce (reduce-scatter
    under SP): the forward, hence the loss, stays right; the gradients entering the norms are per-rank partials."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    original = PrepareModuleInput._prepare_input_arg

    def prepare(self, input, mesh, input_layout, desired_layout):
        out = original(self, input, mesh, input_layout, desired_layout)
        if isinstance(out, DTensor) and desired_layout == Replicate():
            out = _GradNotReduced.apply(out)
        return out

    with patched(PrepareModuleInput, "_prepare_input_arg", prepare):
        yield


@contextlib.contextmanager
def _ce_no_max_all_reduce():
    """The vocab-parallel cross entropy uses each rank's own row max instead of the global one."""
    import titanlike.parallel.loss_parallel as lp

    original = lp._all_reduce
    with patched(lp, "_all_reduce", lambda t, op, group: t if op == dist.ReduceOp.MAX else original(t, op, group)):
        yield


@contextlib.contextmanager
def _sp_norm_plain():
    """Under SP, the norms are left plain modules running on the local sequence shard (the norm is per token, so
    the forward stays right): each rank's weight gradient covers only its part of the sequence, never summed."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    import titanlike.parallel.tensor_parallel as tpm

    def plain_norm(sequence_parallel):
        seq = Shard(1) if sequence_parallel else Replicate()
        return PrepareModuleInputOutput(
            input_layouts=seq,
            desired_input_layouts=seq,
            use_local_input=True,
            output_layouts=seq,
            desired_output_layouts=seq,
            use_local_output=False,
        )

    # apply_tp now refuses a plan that leaves parameters plain next to DTensors (this one, up front); the mutation
    # switches that check off to show the gate itself catches the wrong gradients too.
    with patched(tpm, "_norm_style", plain_norm), patched(tpm, "_check_all_or_nothing", lambda model: None):
        yield


@contextlib.contextmanager
def _qk_norm_replicated():
    """Qwen3's per-head q/k norms get ReplicateParallel (the style for a norm on the replicated stream): each rank's
    local heads are taken as a replica, so each rank's weight gradient covers only its heads and is never summed
    over tp; the forward stays exact (issue 26's trap for norms over heads). ReplicateParallel's replica check
    refuses this at step 1 (tests/parallel/test_traps.py); the mutation switches it off (``check="never"``) to show
    the gate itself catches the wrong gradients too."""
    import titanlike.parallel.tensor_parallel as tpm

    with patched(tpm, "_head_norm_style", lambda entry: tpm.ReplicateParallel(check="never")):
        yield


@contextlib.contextmanager
def _loss_mean_per_rank():
    """Each data-parallel rank divides by its own token count (count_tokens skips the dp all-reduce)."""
    import titanlike.training.step as step

    original = step.count_tokens
    with patched(step, "count_tokens", lambda micro_batches, dp_group=None: original(micro_batches, None)):
        yield


@contextlib.contextmanager
def _fsdp_average():
    """FSDP keeps its default: gradients averaged over the data-parallel ranks instead of summed."""
    import titanlike.parallel.fsdp as fsdp

    with patched(fsdp, "_sum_gradients", lambda module: None):
        yield


@contextlib.contextmanager
def _act_offload_stale():
    """The activation offload hands the backward a stale saved tensor: the first one brought back from the host
    with the same shape and dtype (an earlier block's, or an earlier step's) instead of this one; the forward is
    untouched (the parameters, kept as they are, stay right)."""
    import titanlike.parallel.activation_offload as ao

    first: dict = {}

    def stale(saved):
        tensor = ao.unpack_to_device(saved)
        if isinstance(saved, torch.Tensor):
            return tensor
        return first.setdefault((tuple(tensor.shape), tensor.dtype), tensor)

    with patched(ao, "_unpack", stale):
        yield


@contextlib.contextmanager
def _cpu_offload_stale_device_copy():
    """FSDP's CPU offload all-gathers a stale copy of the host shards: the updated shards are not moved to the
    device again after the optimizer step (each group's first all-gather input is kept), so step 1 is right and
    step 2 computes with the initial weights."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    prop = FSDPParam.all_gather_inputs
    kept: dict = {}

    def stale(self):
        inputs = prop.fget(self)
        if not self.offload_to_cpu:
            return inputs
        return kept.setdefault(id(self), [t.clone() for t in inputs])

    with patched(FSDPParam, "all_gather_inputs", property(stale)):
        yield


@contextlib.contextmanager
def _zero1_not_all_gathered():
    """ZeRO-1 without the all-gather after the step: each rank keeps the update of its own rows of every parameter
    (the rows whose moments it holds) and the old values of the others."""
    import titanlike.parallel.zero as zero

    original = zero.shard_optimizer_state

    def local_rows_only(optimizer, mesh_dim=0):
        original(optimizer, mesh_dim)
        step = optimizer.step

        def stepped(*args, **kwargs):
            params = [p for g in optimizer.param_groups for p in g["params"] if p.ndim]
            before = [p.to_local().clone() for p in params]
            out = step(*args, **kwargs)
            with torch.no_grad():
                for p, old in zip(params, before):
                    mine = optimizer.state[p]["exp_avg"]
                    rows = mine.to_local().shape[0]
                    keep = torch.ones(p.shape[0], dtype=torch.bool)
                    offset = _row_offset(mine, mesh_dim)
                    keep[offset : offset + rows] = False
                    p.to_local()[keep] = old[keep]
            return out

        optimizer.step = stepped
        return optimizer

    with patched(zero, "shard_optimizer_state", local_rows_only):
        yield


def _row_offset(sharded, mesh_dim: int) -> int:
    """The first row of this rank's slice of a DTensor sharded on dim 0 over ``mesh_dim`` (torch.chunk's cut)."""
    n, world = sharded.shape[0], sharded.device_mesh.size(mesh_dim)
    per = -(-n // world)
    return min(per * sharded.device_mesh.get_local_rank(mesh_dim), n)


@contextlib.contextmanager
def _fused_plain_colwise():
    """GPT-2's fused q|k|v projection gets a plain ColwiseParallel: rank 0 of 2 computes all of q and half of k,
    and the attention silently mixes q, k and v across heads (what a user gets without FusedColwiseParallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    import titanlike.parallel.tensor_parallel as tpm

    with patched(tpm, "_fused_style", lambda entry: ColwiseParallel()):
        yield


@contextlib.contextmanager
def _eval_keeps_unsharded():
    """The no-grad validation forward leaves FSDP's root / head groups unsharded (what the trainer did before
    eval_loss_sum resharded): the next step's gradient norm and update go wrong."""
    import titanlike.training.step as step

    with patched(step, "reshard_fsdp", lambda module: None):
        yield


@contextlib.contextmanager
def _cp_kv_grad_not_reduced():
    """The K/V all-gather's backward keeps this rank's slice of its own gradient instead of reduce-scattering: the
    contributions of the other ranks' queries to this rank's keys and values are lost (the forward is right)."""
    import titanlike.parallel.context_parallel as cpm

    def own_slice(grad, mesh):
        return grad.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].contiguous()

    with patched(cpm, "_kv_grad_reduce", own_slice):
        yield


@contextlib.contextmanager
def _cp_chunks_wrong_order():
    """The gathered K/V are used in rank order as if it were the sequence order (no load-balance bookkeeping)."""
    import titanlike.parallel.context_parallel as cpm

    with patched(cpm, "reorder_gathered", lambda t, cp: t):
        yield


@contextlib.contextmanager
def _a2a_heads_order():
    """Ulysses: the output's head groups joined back in the reverse order of the ranks they came from."""
    import titanlike.parallel.context_parallel as cpm

    original = cpm._join_heads
    with patched(cpm, "_join_heads", lambda t: original(t.flip(0))):
        yield


class _NoExchangeBackward(torch.autograd.Function):
    """The all-to-all in forward; in backward the gradient kept where it is (no reverse all-to-all)."""

    @staticmethod
    def forward(ctx, t, mesh, exchange):
        return exchange(t.detach(), mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


@contextlib.contextmanager
def _a2a_no_grad():
    """Ulysses: the all-to-alls' backward skipped (each rank keeps the gradient of the pieces it received as if it
    were its own): the forward is exact, the gradients of q, k, v go to the wrong tokens and heads."""
    import titanlike.parallel.context_parallel as cpm

    original = cpm._all_to_all
    with patched(cpm, "_all_to_all", lambda t, mesh: _NoExchangeBackward.apply(t, mesh, original)):
        yield


@contextlib.contextmanager
def _a2a_sinks_heads():
    """Ulysses: every cp rank takes the sinks of the first head group instead of its own."""
    import titanlike.parallel.context_parallel as cpm

    with patched(cpm, "_head_slice", lambda t, cp, rank: t[: t.shape[0] // cp]):
        yield


@contextlib.contextmanager
def _ring_step_skipped():
    """Ring attention: the last ring step skipped (each rank never sees one rank's keys and values)."""
    import titanlike.parallel.ring_attention as ra

    original = ra.ring_steps
    with patched(ra, "ring_steps", lambda cp, layout, c, window: original(cp, layout, c, window)[:-1]):
        yield


@contextlib.contextmanager
def _ring_window_step_skipped():
    """Ring attention: a sliding-window layer's last needed step skipped (the wrap-around one: chunk
    ``2 cp - 1 - r`` never sees the end of chunk ``2 cp - 2 - r`` on rank ``r + 1``); full layers keep theirs."""
    import titanlike.parallel.ring_attention as ra

    original = ra.ring_steps

    def ring_steps(cp, layout, c, window):
        steps = original(cp, layout, c, window)
        return steps if window is None else steps[:-1]

    with patched(ra, "ring_steps", ring_steps):
        yield


@contextlib.contextmanager
def _ring_latent_weight_dropped():
    """Ring attention over MLA's latent: the up-projection's weight gradient of the visiting blocks dropped (only
    this rank's own tokens' reach it; the forward is exact)."""
    import titanlike.parallel.ring_attention as ra

    with patched(ra, "visiting_weight_grads", lambda grads: tuple(None for _ in grads)):
        yield


@contextlib.contextmanager
def _ring_merge_max():
    """Ring attention: the blocks' log-sum-exps merged by their maximum instead of logaddexp (the weights of the
    outputs then sum to more than one)."""
    import titanlike.parallel.ring_attention as ra

    def merge(out, lse, out_b, lse_b):
        new = torch.maximum(lse, lse_b)
        return torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new).unsqueeze(-1) * out_b, new

    with patched(ra, "merge", merge):
        yield


@contextlib.contextmanager
def _ring_grads_kept():
    """Ring attention's backward: the key / value gradients stay on the rank that computed them instead of
    travelling with their keys back home (the forward is exact)."""
    import titanlike.parallel.ring_attention as ra

    with patched(ra, "passed_on", lambda kept, arrived: kept):
        yield


@contextlib.contextmanager
def _ring_no_sinks():
    """Ring attention: the sinks not merged into the final log-sum-exp."""
    import titanlike.parallel.ring_attention as ra

    original = ra.ring_attention

    def ring_attention(q, k, v, mesh, layout, starts=None, window=None, sinks=None):
        return original(q, k, v, mesh, layout, starts, window, None)

    with patched(ra, "ring_attention", ring_attention):
        yield


@contextlib.contextmanager
def _cp_rope_local():
    """The position seam gives each cp rank its local positions 0..s-1 instead of its tokens' global ones (the RoPE
    rows, or GPT-2's learned positions, of the wrong tokens)."""
    import titanlike.parallel.context_parallel as cpm

    local = lambda seq_len, cp, rank, device: torch.arange(seq_len // cp, device=device)  # noqa: E731
    with patched(cpm, "_global_positions", local):
        yield


_DP_ONLY: dict = {}  # loss group (dp x cp) -> the dp group alone (None: one data-parallel rank)


@contextlib.contextmanager
def _cp_tokens_per_rank():
    """The token count (the loss denominator) is summed over the data-parallel ranks only, not over dp x cp: each cp
    rank divides its tokens' loss by its own count."""
    import titanlike.training.step as step

    original = step.count_tokens
    with patched(
        step,
        "count_tokens",
        lambda micro_batches, dp_group=None: original(micro_batches, _DP_ONLY.get(dp_group, dp_group)),
    ):
        yield


@contextlib.contextmanager
def _to_empty_drops_grad_hooks():
    """Materialising a model parallelized on the meta device with a plain ``to_empty``: the parameters are new
    tensors, and tensor parallelism's post-accumulate-grad hooks (gradient -> the parameter's placements) are lost,
    so sequence-parallel norms keep ``Partial`` gradients (reduced late, in the optimizer) and a vocab-parallel
    embedding a ``Replicate`` one."""
    import titanlike.parallel.materialize as materialize
    from titanlike.parallel.ties import retie

    def plain(model, device):
        groups = tie_groups(model)
        model.to_empty(device=device)
        retie(model, groups)

    with patched(materialize, "to_empty_keeping_ties", plain):
        yield


@contextlib.contextmanager
def _init_ignores_shards():
    """Each rank generates its local tensor as if it were the start of the full one (the init of torchtitan's meta
    path, per local shard): every rank's shard holds the same values, so the initial weights depend on the layout."""
    import titanlike.init as init

    def local_indices(t):
        return [torch.arange(n) for n in (t.to_local() if isinstance(t, DTensor) else t).shape]

    with patched(init, "local_indices", local_indices):
        yield


@contextlib.contextmanager
def _init_strided_as_shard():
    """The chunk-sharded (``_StridedShard``) fused c_attn taken as a plain ``Shard``: rank r generates a contiguous
    block, not its slice of each of q, k and v."""
    from torch.distributed.tensor import Shard

    import titanlike.init as init

    original = init.local_indices

    def local_indices(t):
        if isinstance(t, DTensor) and any(type(p).__name__ == "_StridedShard" for p in t.placements):
            t = DTensor.from_local(
                t.to_local(),
                t.device_mesh,
                [Shard(p.dim) if type(p).__name__ == "_StridedShard" else p for p in t.placements],
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        return original(t)

    with patched(init, "local_indices", local_indices):
        yield


@contextlib.contextmanager
def _muon_local_ns():
    """Muon orthogonalizes each rank's own shard of a matrix (no gather): Newton-Schulz of a block is not the
    block of Newton-Schulz, so the update is wrong although every rank did "the same" as one device."""
    import titanlike.parallel.muon as muon

    def local(gr, bucket, updates, opt):
        out = []
        for k in bucket.items:
            m = gr.matrices[k]
            block = muon._narrow(updates[m.param], [(s, e - s) for s, e in m.mine.block])
            out.append((m, opt._ns(block.reshape(m.mine.shape[-2:]), m).reshape(m.mine.shape)))
        return out

    with patched(muon, "_orthogonalize_bucket", local):
        yield


@contextlib.contextmanager
def _muon_fused_one_matrix():
    """GPT-2's fused q|k|v orthogonalized as one (3 dim x dim) matrix instead of three: what an optimizer that
    treats every 2-D parameter as a matrix does."""
    from titanlike.sharding import FusedColwise, whole_matrix

    with patched(FusedColwise, "matrices", lambda self, leaf, shape: whole_matrix(shape) if leaf == "weight" else None):
        yield


@contextlib.contextmanager
def _muon_not_scattered():
    """The owner applies its orthogonalized matrix to its own shard only; the other ranks' shards get no update
    (only the weight decay)."""
    import titanlike.parallel.muon as muon

    original = muon._orthogonalize_bucket

    def owner_only(gr, bucket, updates, opt):
        out = original(gr, bucket, updates, opt)
        return [(m, b if o == gr.rank else torch.zeros_like(b)) for (m, b), o in zip(out, bucket.owners)]

    with patched(muon, "_orthogonalize_bucket", owner_only):
        yield


@contextlib.contextmanager
def _mask_cp_rank():
    """Context parallelism: cp rank 1's attention ignores the document starts (plain causal over the gathered keys);
    rank 0 masks right."""
    import titanlike.parallel.context_parallel as cpm

    original = cpm.ContextParallelAttention.forward

    def forward(self, q, k, v, mask=None):
        return original(self, q, k, v, None if self.rank == 1 else mask)

    with patched(cpm.ContextParallelAttention, "forward", forward):
        yield


@contextlib.contextmanager
def _cp_state_not_passed():
    """Linear attention under cp: every piece starts from the zero state (no scan over the cp ranks' maps)."""
    import titanlike.parallel.state_passing as spm

    def zeros(maps, dv, upto):
        return [torch.zeros_like(maps[0, ..., :dv])] * (upto + 1)

    with patched(spm, "entering_states", zeros):
        yield


@contextlib.contextmanager
def _cp_scan_rank_order():
    """Linear attention under cp: the gathered state maps scanned in placement (rank) order, not sequence order."""
    import titanlike.parallel.state_passing as spm

    with patched(spm, "true_order", lambda gathered, chunks_of_rank: gathered):
        yield


@contextlib.contextmanager
def _cp_no_conv_halo():
    """Linear attention under cp: each piece's short conv starts from zeros instead of the previous piece's inputs."""
    import titanlike.parallel.state_passing as spm

    with patched(spm, "halo_before", lambda tails, chunk, kernel: None):
        yield


@contextlib.contextmanager
def _delta_no_reset():
    """The gated delta rule's state is not reset at document starts (the conv still is)."""
    import titanlike.models.linear_attention as la

    original = la._doc_masks
    with patched(la, "_doc_masks", lambda starts, *rest: original(torch.zeros_like(starts), *rest)):
        yield


@contextlib.contextmanager
def _delta_decay_sign():
    """Gated DeltaNet's decay with the wrong sign: g = +exp(A_log) softplus(a + dt_bias)."""
    from titanlike.models.qwen3_next.model import DeltaDecay

    original = DeltaDecay.forward

    def flipped(self, b, a):
        beta, g = original(self, b, a)
        return beta, -g

    with patched(DeltaDecay, "forward", flipped):
        yield


@contextlib.contextmanager
def _delta_beta_raw():
    """Gated DeltaNet's write strength without its sigmoid: beta = b."""
    from titanlike.models.qwen3_next.model import DeltaDecay

    original = DeltaDecay.forward

    def raw(self, b, a):
        return b, original(self, b, a)[1]

    with patched(DeltaDecay, "forward", raw):
        yield


@contextlib.contextmanager
def _no_shared_gate():
    """The MoE block's shared expert added without its sigmoid gate."""
    from titanlike.models.moe import MoE

    original = MoE.forward

    def ungated(self, x):
        gate, self.shared_gate = self.shared_gate, None
        try:
            return original(self, x)
        finally:
            self.shared_gate = gate

    with patched(MoE, "forward", ungated):
        yield


_RESET = {"apply": True}  # build_model sets model.reset_position_ids from the config unless a mutation says not


@contextlib.contextmanager
def _mask_no_reset():
    """model.reset_position_ids asked for, the parallel model built without it: positions run on across documents."""
    _RESET["apply"] = False
    try:
        yield
    finally:
        _RESET["apply"] = True


@contextlib.contextmanager
def _moe_local_loads():
    """The expert-bias update from this rank's tokens per expert instead of the global batch's."""
    import titanlike.parallel.expert_parallel as epm

    with patched(epm, "_all_reduce_loads", lambda loads, group: loads):
        yield


@contextlib.contextmanager
def _moe_aux_per_rank():
    """The aux loss's denominator: this rank's sequences instead of the global batch's."""
    from titanlike.parallel.expert_parallel import ExpertBalancing

    begin = ExpertBalancing.begin_step

    def per_rank(self, micro_batches):
        dp, self.dp = self.dp, 1
        try:
            begin(self, micro_batches)
        finally:
            self.dp = dp

    with patched(ExpertBalancing, "begin_step", per_rank):
        yield


@contextlib.contextmanager
def _moe_router_not_over_tp():
    """ep borrowing tp: the MoE blocks' router and shared experts FSDP-sharded over the data ranks only (as a dense
    block's weights), their gradients not summed over the tp ranks, which routed other tokens."""
    from titanlike.parallel.dims import ParallelDims

    with patched(ParallelDims, "moe_token_mesh", lambda self: self.fsdp_mesh()):
        yield


@contextlib.contextmanager
def _moe_aux_counts_not_over_tp():
    """ep borrowing tp: the sequence-wise aux loss counts each sequence's tokens over cp only, not over the tp ranks
    holding its other parts (as without tp)."""
    import titanlike.parallel.parallelize as parallelize
    from titanlike.parallel.dims import ParallelDims

    real = ParallelDims.get_mesh

    def cp_only(self, names):
        return real(self, "cp" if names == "cp_tp" else names)

    with patched(ParallelDims, "get_mesh", cp_only):
        assert parallelize.set_aux_sequence_group  # parallelize_model asks dims for the aux group's mesh
        yield


@contextlib.contextmanager
def _moe_expert_fsdp_average():
    """The experts' FSDP groups average their gradients over the ranks holding the same experts (FSDP's default)
    instead of summing them."""
    import titanlike.parallel.build as build
    from titanlike.parallel.expert_parallel import experts_modules

    parallelize = build.parallelize_model

    def averaging(model, dims, cfg):
        model = parallelize(model, dims, cfg)
        for _, m in experts_modules(model):
            m.set_gradient_divide_factor(float(dims.dp_shard_mod_ep))
        return model

    with patched(build, "parallelize_model", averaging):
        yield


@contextlib.contextmanager
def _window_off_by_one():
    """The sliding window's exact mask keeps one key too many (``j >= p - w`` instead of ``j > p - w``)."""
    from titanlike.models.masking import DocumentMask

    original = DocumentMask.dense

    def dense(self, lo, hi, n, window=None, key_start=0):
        return original(self, lo, hi, n, None if window is None else window + 1, key_start)

    with patched(DocumentMask, "dense", dense):
        yield


@contextlib.contextmanager
def _ds_rope_on_nope():
    """MLA turns the first qk_rope_head_dim dims of every q / k head (the non-rope part) instead of its rope part."""
    from titanlike.models.deepseek_v3 import MLA

    def forward(self, x, *, cos, sin, mask=None):
        a, (b, s, _) = self.args, x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        q = q.view(b, s, -1, a.qk_head_dim)
        latent, k_pe = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        r = a.qk_rope_head_dim

        def expand(latent, k_pe):  # RoPE on the first r dims of each key (its non-rope part)
            k, v = self.expand(latent, k_pe)
            return torch.cat([self.rope(k[..., :r], cos, sin), k[..., r:]], dim=-1), v

        q = torch.cat([self.rope(q[..., :r], cos, sin), q[..., r:]], dim=-1) * self.q_scale
        return self.wo(
            self.core(q, self.kv_norm(latent), self.k_rope(k_pe).unsqueeze(2), expand, mask).reshape(b, s, -1)
        )

    with patched(MLA, "forward", forward):
        yield


@contextlib.contextmanager
def _window_local():
    """Under cp the mask's query positions are the rank's local ones (0 .. s-1), not its chunks' global positions:
    the window (and the causal bound) measured from the wrong place. (RoPE keeps its global positions.)"""
    from titanlike.models.masking import DocumentMask

    original = DocumentMask.__post_init__

    def post_init(self):
        self.positions = torch.arange(self.positions.shape[0], device=self.positions.device)
        original(self)

    with patched(DocumentMask, "__post_init__", post_init):
        yield


@contextlib.contextmanager
def _ds_latent_norm_unsplit():
    """MLA's latent RMSNorm computed over the whole down-projection (latent and RoPE key) before the split, instead
    of over the latent after it."""
    from titanlike.models.deepseek_v3 import MLA

    def forward(self, x, *, cos, sin, mask=None):
        a, (b, s, _) = self.args, x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        q_nope, q_pe = q.view(b, s, -1, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv = kv * torch.rsqrt(kv.pow(2).mean(-1, keepdim=True) + self.kv_norm.eps)
        latent, k_pe = kv.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_pe = self.rope(self.k_rope(k_pe).unsqueeze(2), cos, sin)
        q = torch.cat([q_nope, self.rope(q_pe, cos, sin)], dim=-1) * self.q_scale
        return self.wo(self.core(q, latent * self.kv_norm.weight, k_pe, self.expand, mask).reshape(b, s, -1))

    with patched(MLA, "forward", forward):
        yield


@contextlib.contextmanager
def _sinks_dropped():
    """The context-parallel core drops the sinks it is given (plain softmax attention)."""
    import titanlike.parallel.context_parallel as cpm

    original = cpm.ContextParallelAttention.forward

    def forward(self, q, k, v, mask=None, sinks=None):
        return original(self, q, k, v, mask, None)

    with patched(cpm.ContextParallelAttention, "forward", forward):
        yield


@contextlib.contextmanager
def _ds_bias_in_weights():
    """The correction bias added to the combine weights too (it must steer the selection only); zero at step 1, so
    it shows once the first bias update has moved it."""
    from titanlike.models.moe import Router

    route = Router.forward

    def forward(self, x, expert_bias=None):
        scores, idx, weights = route(self, x, expert_bias)
        if expert_bias is not None:
            weights = weights + expert_bias.to(weights.dtype)[idx]
        return scores, idx, weights

    with patched(Router, "forward", forward):
        yield


@contextlib.contextmanager
def _sinks_not_split():
    """The sinks replicated over tp instead of split with their heads: every rank uses the first heads' sinks."""
    import titanlike.parallel.tensor_parallel as tpm

    def replicate(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

    class FirstHeads(tpm.ParallelStyle):
        def _apply(self, module, mesh):
            local = module.weight.shape[0] // mesh.size()
            first = lambda mod, out, mesh: out.to_local()[:local]  # noqa: E731
            return tpm.distribute_module(module, mesh, replicate, output_fn=first)

    with patched(tpm, "_head_params_style", lambda entry: FirstHeads()):
        yield


@contextlib.contextmanager
def _clamp_missing():
    """gpt-oss's experts without the clamp of gate and up (the plain ``(up + 1) g sigmoid(alpha g)``)."""
    import titanlike.models.moe as moe

    with patched(moe, "clamped_swiglu", lambda g, u, alpha, limit: (u + 1) * g * torch.sigmoid(alpha * g)):
        yield


@contextlib.contextmanager
def _ds_no_group_limit():
    """Group-limited routing skipped: every token picks its top-k over all experts."""
    import titanlike.models.moe as moe

    with patched(moe, "_limit_to_top_groups", lambda choice, groups, topk: choice):
        yield


@contextlib.contextmanager
def _hf_window_dropped():
    """model.name = "hf": the sliding-window layers get no mask (the library's SDPA attention then runs full causal)."""
    import titanlike.models.transformers_lm.model as lm

    with patched(lm, "layer_windows", lambda config: [None] * config.num_hidden_layers):
        yield


@contextlib.contextmanager
def _ds_mtp_shift():
    """The MTP depth k trained against the labels shifted by k + 1 (one position too far)."""
    import titanlike.loss as loss

    shift = loss.shift_labels
    with patched(loss, "shift_labels", lambda labels, k: shift(labels, k + 1)):
        yield


@contextlib.contextmanager
def _ds_latent_replicated():
    """MLA's latent projections and norms get ReplicateParallel (a module on the replicated stream) instead of the
    Latent style: each rank's heads give them only a partial gradient, never summed over tp."""
    import titanlike.parallel.tensor_parallel as tpm

    with patched(tpm, "LatentParallel", lambda local_output=False: tpm.ReplicateParallel(check="never")):
        yield


@contextlib.contextmanager
def _ds_stream_linear_unsummed():
    """Under SP, the MTP depths' ``eh_proj`` (a Linear on the stream: StreamParallel's local matmul) takes its
    weight's local tensor with a ``Replicate`` gradient: each rank's gradient covers only its part of the sequence,
    never summed over tp."""
    import torch.nn.functional as F

    import titanlike.parallel.tensor_parallel as tpm

    def unsummed(module, mesh, x):
        y = F.linear(x.to_local(), module.weight.to_local(), None)
        return DTensor.from_local(y, mesh, (Shard(1),), run_check=False)

    with patched(tpm, "_stream_linear", unsummed):
        yield


@contextlib.contextmanager
def _ds_cp_latent_no_rope():
    """Context parallelism gathers MLA's latent but not the shared RoPE key: every rank's own keys stand in for the
    other ranks' tokens."""
    import titanlike.parallel.context_parallel as cpm

    gather = cpm._gather_replicated

    def latent_only(t, mesh):
        return gather(t, mesh) if t.dim() == 3 else torch.cat([t] * mesh.size(), dim=1)

    with patched(cpm, "_gather_replicated", latent_only):
        yield


@contextlib.contextmanager
def _ds_cp_local_shift():
    """Under context parallelism the MTP depths' labels shifted within each rank's own (non-contiguous) chunks."""
    import titanlike.parallel.context_parallel as cpm
    from titanlike.loss import shift_labels

    with patched(cpm, "cp_shift_labels", lambda mesh: shift_labels):
        yield


MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "hf_window_dropped": _hf_window_dropped,
    "window_off_by_one": _window_off_by_one,
    "window_local": _window_local,
    "sinks_dropped": _sinks_dropped,
    "sinks_not_split": _sinks_not_split,
    "clamp_missing": _clamp_missing,
    "ds_latent_norm_unsplit": _ds_latent_norm_unsplit,
    "ds_cp_local_shift": _ds_cp_local_shift,
    "ds_cp_latent_no_rope": _ds_cp_latent_no_rope,
    "ds_rope_on_nope": _ds_rope_on_nope,
    "ds_bias_in_weights": _ds_bias_in_weights,
    "ds_no_group_limit": _ds_no_group_limit,
    "ds_mtp_shift": _ds_mtp_shift,
    "ds_latent_replicated": _ds_latent_replicated,
    "ds_stream_linear_unsummed": _ds_stream_linear_unsummed,
    "cp_state_not_passed": _cp_state_not_passed,
    "cp_scan_rank_order": _cp_scan_rank_order,
    "cp_no_conv_halo": _cp_no_conv_halo,
    "delta_no_reset": _delta_no_reset,
    "delta_decay_sign": _delta_decay_sign,
    "delta_beta_raw": _delta_beta_raw,
    "no_shared_gate": _no_shared_gate,
    "mask_cp_rank": _mask_cp_rank,
    "mask_no_reset": _mask_no_reset,
    "moe_local_loads": _moe_local_loads,
    "moe_aux_per_rank": _moe_aux_per_rank,
    "moe_expert_fsdp_average": _moe_expert_fsdp_average,
    "moe_router_not_over_tp": _moe_router_not_over_tp,
    "moe_aux_counts_not_over_tp": _moe_aux_counts_not_over_tp,
    "muon_local_ns": _muon_local_ns,
    "muon_fused_one_matrix": _muon_fused_one_matrix,
    "muon_not_scattered": _muon_not_scattered,
    "to_empty_drops_grad_hooks": _to_empty_drops_grad_hooks,
    "init_ignores_shards": _init_ignores_shards,
    "init_strided_as_shard": _init_strided_as_shard,
    "fused_plain_colwise": _fused_plain_colwise,
    "act_offload_stale": _act_offload_stale,
    "zero1_not_all_gathered": _zero1_not_all_gathered,
    "cpu_offload_stale_device_copy": _cpu_offload_stale_device_copy,
    "eval_keeps_unsharded": _eval_keeps_unsharded,
    "cp_kv_grad_not_reduced": _cp_kv_grad_not_reduced,
    "cp_chunks_wrong_order": _cp_chunks_wrong_order,
    "a2a_heads_order": _a2a_heads_order,
    "a2a_no_grad": _a2a_no_grad,
    "a2a_sinks_heads": _a2a_sinks_heads,
    "ring_step_skipped": _ring_step_skipped,
    "ring_merge_max": _ring_merge_max,
    "ring_grads_kept": _ring_grads_kept,
    "ring_no_sinks": _ring_no_sinks,
    "ring_window_step_skipped": _ring_window_step_skipped,
    "ring_latent_weight_dropped": _ring_latent_weight_dropped,
    "cp_rope_local": _cp_rope_local,
    "cp_tokens_per_rank": _cp_tokens_per_rank,
    "tp_no_backward_reduce": _tp_no_backward_reduce,
    "ce_no_max_all_reduce": _ce_no_max_all_reduce,
    "sp_norm_plain": _sp_norm_plain,
    "qk_norm_replicated": _qk_norm_replicated,
    "loss_mean_per_rank": _loss_mean_per_rank,
    "fsdp_average": _fsdp_average,
}


# ---------------------------------------------------------------------------------------------- data, reference
EOS = 1  # the end-of-text token of the masked models' batches


def global_batch(step: int, documents: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: different tokens every step, and an uneven number of ignored labels per
    row, so every data-parallel rank holds a different number of tokens. ``documents``: packed documents, EOS at
    different places in every row and step (documents crossing the cp chunks; a row may start inside one)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    if documents:
        tokens[tokens == EOS] = EOS + 1
        for row in range(GLOBAL_BATCH):
            first = (5 * row + step) % 9
            tokens[row, [first, first + 1 + (row + step) % 6]] = EOS
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(GLOBAL_BATCH):
        labels[row, : (3 * row + step) % 11] = IGNORE_INDEX
    return inputs, labels


def step_batch(cfg: JobConfig, step: int) -> tuple[torch.Tensor, ...]:
    """Step ``step``'s global batch for ``cfg``: (inputs, labels), or with document masking (inputs, labels,
    document_starts) as the data loaders carry them."""
    if cfg.model.attn_mask_type != "block_causal":
        return global_batch(step)
    from titanlike.models.masking import document_starts

    inputs, labels = global_batch(step, documents=True)
    return inputs, labels, document_starts(inputs, EOS)


def cut_batch(batch: tuple[torch.Tensor, ...], cut: Callable[[torch.Tensor], torch.Tensor], n: int) -> list[tuple]:
    """This rank's ``n`` micro-batches of a global batch: ``cut`` (rows, cp chunks) of every tensor, chunked."""
    return list(zip(*(cut(t).chunk(n) for t in batch)))


def _starts(mb: tuple) -> torch.Tensor | None:
    return mb[2] if len(mb) > 2 else None


def config(layout: Layout, world_size: int) -> JobConfig:
    base = TRAIN_ARGS if layout.model in HF_MODELS else BASE_ARGS
    return load_config([*base, *MODELS[layout.model], *layout.args], world_size=world_size)


INIT_SEED = 0  # the training.seed of every gate model


def build_model(cfg: JobConfig, device: str = "cpu") -> nn.Module:
    """The seeded float64 model (same weights on every rank and for every layout of the same model)."""
    args = model_args_from_config(cfg, vocab_size=VOCAB)
    with torch.device(device):
        model = get_spec(cfg.model.name).build(args).to(torch.float64)
    if device != "meta":
        model.init_weights(seed=INIT_SEED)
    model.reset_position_ids = cfg.model.reset_position_ids and _RESET["apply"]
    return model


# Models that are not registered titanlike models (a user's module): key of MODELS -> seeded float64 constructor.
CUSTOM_MODELS: dict[str, Callable[[], nn.Module]] = {}


@dataclass
class Record:
    loss: float
    grad_norm: float
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor] = field(default_factory=dict)  # the MoE blocks' expert biases (buffers)
    mtp: list[float] | None = None  # the MTP depths' losses (a model with MTP)


def expert_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """The expert-bias buffers of a model's MoE blocks, by FQN (empty for a dense model)."""
    return {n: b for n, b in model.named_buffers() if n.endswith(".expert_bias")}


def moe_balancing(model: nn.Module):
    """One device's side of the MoE blocks (the aux denominator, the bias update), None for a dense model."""
    from titanlike.parallel.expert_parallel import ExpertBalancing, experts_modules

    return ExpertBalancing([model], None, 1) if experts_modules(model) else None


def _all_names(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


class Context:
    """Per-process state: the world size, the reference run per model."""

    def __init__(self, world_size: int):
        self.world_size = world_size

        self.references: dict[str, list[Record]] = {}
        self._dims: dict = {}  # mesh shape -> ParallelDims with its meshes built

    def dims(self, cfg: JobConfig):
        """The layout's ``ParallelDims`` with its meshes, built once per shape for the whole run (one process group
        runs every layout: no new groups per layout)."""
        from titanlike.parallel import ParallelDims

        dims = ParallelDims.from_config(cfg, self.world_size)
        key = (dims.shape, dims.ep)  # the expert degree is not a dim of the 5-D mesh: part of the key
        if key not in self._dims:
            dims.build_mesh("cpu")
            self._dims[key] = dims
        return self._dims[key]

    def reference(self, layout: Layout, cfg: JobConfig) -> tuple[nn.Module, list[Record]]:
        """The initial model and, per step, what one device computes on the full global batch."""
        model = CUSTOM_MODELS[layout.model]() if layout.model in CUSTOM_MODELS else build_model(cfg)
        if layout.model not in self.references:
            ref = copy.deepcopy(model)
            opt = build_optimizer([ref], cfg)
            records = []
            moe = moe_balancing(ref)
            for step in range(1, STEPS + 1):
                res = train_step(
                    [ref],
                    opt,
                    [step_batch(cfg, step)],
                    ScaledLoss(_plain_loss(cfg), mtp_weight=cfg.training.mtp_loss_weight),
                    max_norm=cfg.training.max_norm,
                    clip_fn=plain_clip_grad_norm_,
                    moe=moe,
                )
                named = _all_names(ref)
                records.append(
                    Record(
                        res.loss,
                        res.grad_norm,
                        {n: p.grad.detach().clone() for n, p in named.items()},
                        {n: p.detach().clone() for n, p in named.items()},
                        {n: b.detach().clone() for n, b in expert_biases(ref).items()},
                        res.mtp,
                    )
                )
            self.references[layout.model] = records
        return model, self.references[layout.model]

    def reference_eval(self, layout: Layout, cfg: JobConfig) -> float:
        """One device's loss sum over the eval batch with the weights after step 1."""
        key = ("eval", layout.model)
        if key not in self.references:
            model = build_model(cfg)
            first = self.references[layout.model][0]
            model.load_state_dict({**first.weights, **first.biases})
            model.eval()  # as the trainer's validation (an MoE block counts loads and its aux loss in training only)
            inputs, labels, *starts = step_batch(cfg, STEPS + 1)
            kwargs = {"document_starts": starts[0]} if starts else {}
            with torch.no_grad():
                self.references[key] = _plain_loss(cfg)(model(inputs, **kwargs), labels).item()
        return self.references[key]


def _plain_loss(cfg: JobConfig):
    from titanlike.loss import cross_entropy_loss

    return partial(cross_entropy_loss, reduction="sum")


# ---------------------------------------------------------------------------------------------- builders
@dataclass
class Built:
    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    loss: ScaledLoss
    clip_fn: Callable
    # the global batch (inputs, labels[, document_starts]) -> this rank's micro-batches of the same tensors
    micro_batches: Callable[..., list[tuple[torch.Tensor, ...]]]
    step_kwargs: dict = field(default_factory=dict)
    aliases_checked: bool = True  # tied weights are still one parameter in the parallel model
    # (inputs, labels) of the global batch -> this layout's validation loss sum over it, identical on every rank
    # (the trainer's no-grad path); run between steps 1 and 2, so training must continue exactly after it
    eval_sum: Callable[[torch.Tensor, torch.Tensor], float] | None = None


def _load_full_weights(model: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s full weights into the (sharded) parameters of ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True))


def build_spmd(layout: Layout, cfg: JobConfig, ctx: Context, initial: nn.Module) -> Built:
    """Everything but pipelining: ``build_parallel_model`` over the layout's mesh, the trainer's own builder."""
    from titanlike.parallel import build_parallel_model

    dims = ctx.dims(cfg)
    cpu = torch.device("cpu")
    if layout.model in CUSTOM_MODELS or layout.init == "materialised":
        built = build_parallel_model(copy.deepcopy(initial), cfg, dims, cpu)
    elif layout.init == "checkpoint":
        built = build_parallel_model(build_model(cfg, device="meta"), cfg, dims, cpu)
        _load_full_weights(built.model_parts[0], initial)
    else:  # the trainer's fresh start: each rank generates only its shards
        built = build_parallel_model(build_model(cfg, device="meta"), cfg, dims, cpu, init_seed=INIT_SEED)
    model = built.model_parts[0]
    aliases = tie_groups(initial)
    tied_ok = all(len({id(model.get_parameter(n)) for n in names}) == 1 for names in aliases)
    dp_rank, dp = dims.get_mesh("dp").get_local_rank(), dims.dp
    n_micro = cfg.training.global_batch_size // (cfg.training.local_batch_size * dp)

    cp_slice = cp_slicer(dims)

    def micro_batches(*batch):
        rows = GLOBAL_BATCH // dp
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        return cut_batch(batch, lambda t: cp_slice(t[mine]), n_micro)

    loss_fn = built.loss.loss_fn
    group = loss_group_for_gate(dims)

    def eval_sum(*batch):
        from titanlike.training.step import eval_loss_sum

        total = sum(
            eval_loss_sum(model, loss_fn, mb[0], mb[1], built.forward_context, _starts(mb))
            for mb in micro_batches(*batch)
        )
        if group is not None:
            dist.all_reduce(total, group=group)
        return total.item()

    return Built(
        model_parts=[model],
        optimizer=build_optimizer([model], cfg),
        eval_sum=eval_sum,
        loss=built.loss,
        clip_fn=built.clip_fn,
        micro_batches=micro_batches,
        step_kwargs={"dp_group": group, "forward_ctx": built.forward_context, "moe": built.moe},
        aliases_checked=tied_ok,
    )


def cp_slicer(dims) -> Callable[[torch.Tensor], torch.Tensor]:
    """This cp rank's two chunks of every row (the data loader's cut), identity without cp."""
    if not dims.cp_enabled:
        return lambda t: t
    from titanlike.parallel.context_parallel import cp_shard

    cp_mesh = dims.get_mesh("cp")
    return partial(cp_shard, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank(), dim=1)


def loss_group_for_gate(dims):
    """``loss_group(dims)`` (dp x cp), remembering the dp-only group for the per-cp-rank token-count mutation."""
    from titanlike.parallel import loss_group

    group = loss_group(dims)
    if dims.cp_enabled:
        _DP_ONLY[group] = dims.get_mesh("dp").get_group() if dims.dp_enabled else None
    return group


BUILDERS: dict[str, Callable[[Layout, JobConfig, Context, nn.Module], Built]] = {"spmd": build_spmd}


# ---------------------------------------------------------------------------------------------- the gate
def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return (a.detach().to(torch.float64) - b.to(torch.float64)).abs().max().item()


def _diff(t: torch.Tensor, ref: torch.Tensor) -> float:
    """max |t - ref| over what this rank holds of ``t``; ``run_layout`` takes the max over the ranks.

    A DTensor split over its mesh (``Shard``, ``_StridedShard``, ``Replicate``) is compared where it lives: ``ref``
    cut exactly as DTensor cuts (``distribute_tensor`` without a source rank: a local split, no communication)
    against the local tensor. The shards of the ranks together are the full tensor, so the max over the ranks is the
    max over the full tensor, as if gathered, without an all-gather per parameter and step (a quarter of a gate
    launch's time). Any other placement (a ``Partial`` gradient a mutation left) is gathered with ``full_tensor()``.
    """
    if not isinstance(t, DTensor):
        return _max_abs(t, ref)
    if t.shape != ref.shape:
        return math.inf
    if not all(isinstance(p, (Shard, _StridedShard, Replicate)) for p in t.placements):
        return _max_abs(t.full_tensor(), ref)
    local = t.to_local()
    mine = distribute_tensor(ref.detach(), t.device_mesh, t.placements, src_data_rank=None).to_local()
    if local.numel() == 0 and mine.numel() == 0:  # an uneven shard: nothing on this rank
        return 0.0
    return _max_abs(local, mine)


def run_layout(layout: Layout, ctx: Context) -> dict:
    """Train the reference and the layout side by side; return the max differences (reduced over ranks)."""
    t0 = time.perf_counter()
    cfg = config(layout, ctx.world_size)
    initial, records = ctx.reference(layout, cfg)
    diffs = dict(
        init=0.0,
        grad_placements=0.0,
        loss=0.0,
        loss_step1=0.0,
        grad_norm=0.0,
        grads=0.0,
        weights=0.0,
        biases=0.0,
        eval=0.0,
    )
    compared: set[str] = set()
    mutation = MUTATIONS[layout.mutation]() if layout.mutation else contextlib.nullcontext()
    with mutation:
        built = BUILDERS[layout.kind](layout, cfg, ctx, initial)
        start = _all_names(initial)  # the initial weights must equal the single-device init exactly
        for part in built.model_parts:
            for name, p in part.named_parameters():
                diffs["init"] = max(diffs["init"], _diff(p, start[name]))
        zero1 = cfg.parallelism.distributed_optimizer
        muon_comms = _count_optimizer_comms(built.optimizer, zero1)  # Muon: what its last step sent (CommDebugMode)
        expert_comms: dict[str, int] = {}
        compiled = _compile_counts_start(cfg)
        for step in range(1, STEPS + 1):
            ref = records[step - 1]
            with _counting_expert_comms(built, expert_comms, step == 1 and compiled is None):
                res = train_step(
                    built.model_parts,
                    built.optimizer,
                    built.micro_batches(*step_batch(cfg, step)),
                    built.loss,
                    max_norm=cfg.training.max_norm,
                    clip_fn=built.clip_fn,
                    **built.step_kwargs,
                )
            loss_diff = abs(res.loss - ref.loss)
            if res.mtp is not None or ref.mtp is not None:  # each MTP depth's logged loss too
                loss_diff = max([loss_diff] + [abs(a - b) for a, b in zip(res.mtp or [math.inf], ref.mtp or [0.0])])
            diffs["loss"] = max(diffs["loss"], loss_diff)
            if step == 1:
                diffs["loss_step1"] = loss_diff
            diffs["grad_norm"] = max(diffs["grad_norm"], abs(res.grad_norm - ref.grad_norm))
            for part in built.model_parts:
                for name, p in part.named_parameters():
                    compared.add(name)
                    g = math.inf if p.grad is None else _diff(p.grad, ref.grads[name])
                    if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                        diffs["grad_placements"] += 1  # a Partial / Replicate gradient left on a sharded parameter
                    diffs["grads"] = max(diffs["grads"], g)
                    diffs["weights"] = max(diffs["weights"], _diff(p, ref.weights[name]))
                for name, b in expert_biases(part).items():
                    diffs["biases"] = max(diffs["biases"], _max_abs(b, ref.biases[name]))
            if compiled is not None:
                compiled["graphs"].append(dynamo_counters["stats"]["unique_graphs"])
            if step == 1 and built.eval_sum is not None:
                diffs["eval"] = abs(built.eval_sum(*step_batch(cfg, STEPS + 1)) - ctx.reference_eval(layout, cfg))
            if layout.mutation and step < STEPS and _broken_on_some_rank(diffs):
                break  # a planted bug has shown: the steps after it would only show it again
    # Reduce over ranks: NaN counts as infinitely wrong.
    values = torch.tensor([v if v == v else math.inf for v in diffs.values()], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    diffs = dict(zip(diffs, values.tolist()))
    names: list = [None] * ctx.world_size
    dist.all_gather_object(names, sorted(compared))
    every = set(_all_names(initial))
    unique = {n for n, _ in initial.named_parameters()}
    union = set().union(*map(set, names))
    aliases = torch.tensor([int(built.aliases_checked)])
    dist.all_reduce(aliases, op=dist.ReduceOp.MIN)
    checks = {"coverage": unique <= union <= every, "tied_still_tied": bool(aliases.item())}
    muon_stats: list = [None] * ctx.world_size  # what each rank's Muon did in the last step (planner: the same)
    stats = getattr(built.optimizer, "stats", None)
    mine = None if stats is None else {**dataclasses.asdict(stats), "comms": muon_comms}
    dist.all_gather_object(muon_stats, mine)
    return {
        "mutation": layout.mutation,
        "model": layout.model,
        "muon_stats": muon_stats if stats is not None else None,
        "zero1": _zero1_report(built.optimizer, muon_comms, zero1),
        "expert_comms": expert_comms,
        "expert_mesh": _expert_mesh(built),
        "compile": _compile_counts_end(compiled),
        **diffs,
        **checks,
        "ok": diffs["init"] == 0.0
        and diffs["grad_placements"] == 0
        and all(diffs[k] <= TOL for k in ("loss", "grad_norm", "grads", "weights", "biases", "eval"))
        and all(checks.values()),
        "ref_grad_norms": [r.grad_norm for r in records],
        "max_norm": cfg.training.max_norm,
        "steps": step,  # STEPS, or fewer for a mutation that broke the gate earlier
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _compile_counts_start(cfg) -> dict | None:
    """For a compiled layout: dynamo's counters cleared (its caches too, so the layout compiles its own graphs) and
    a record of the graphs compiled so far after each step; None for an eager layout."""
    if not cfg.compile.enable:
        return None
    torch._dynamo.reset()
    dynamo_counters.clear()
    _count_logged_breaks()
    _LOGGED_BREAKS.clear()
    return {"graphs": []}


# Every graph break dynamo logs (TORCH_LOGS=graph_breaks lists the same): counters["graph_break"] leaves out some
# (torch 2.13: a data-dependent branch on a traced value, as the uneven expert dispatch's split-size check)
_LOGGED_BREAKS: list[str] = []


def _count_logged_breaks() -> None:
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    log = InstructionTranslatorBase.log_graph_break
    if getattr(log, "_gate_counting", False):
        return

    def counting(self, code_options, reason, exc):
        if not exc.logged:
            _LOGGED_BREAKS.append(reason.strip().splitlines()[0])
        return log(self, code_options, reason, exc)

    counting._gate_counting = True
    InstructionTranslatorBase.log_graph_break = counting


def _compile_counts_end(compiled: dict | None) -> dict | None:
    """Graph breaks (every one dynamo logs) and graphs compiled per step, the max over the ranks (each rank compiles
    its own blocks)."""
    if compiled is None:
        return None
    breaks = max(len(_LOGGED_BREAKS), sum(dynamo_counters["graph_break"].values()))
    values = torch.tensor([breaks, *compiled["graphs"]], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    breaks, *graphs = (int(v) for v in values.tolist())
    reasons: dict[str, int] = {}  # this rank's, by their first line
    for first in _LOGGED_BREAKS:
        reasons[first] = reasons.get(first, 0) + 1
    return {"graph_breaks": breaks, "graphs_after_step": graphs, "break_reasons": reasons}


def _broken_on_some_rank(diffs: dict[str, float]) -> bool:
    """Whether some rank's differences so far break the gate by more than :data:`BROKEN` (NaN included): a mutation
    layout then stops training, since what its test asserts (the gate fails, the expected metric moved by more than
    BROKEN, a right first forward) is decided by the steps so far. Every rank gets the same answer (one all-reduce)."""
    worst = max((0.0 if v <= BROKEN else 1.0) for k, v in diffs.items() if k != "loss_step1")
    flag = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


_MUON_COUNTS = ("matrices", "ns_flops", "collectives", "sent", "received")


def planner_muon_mismatches(results: dict, layouts: list[Layout], world_size: int) -> list[str]:
    """Where the planner's prediction of a rank's Muon step (titanlike.planner.muon) differs from what the real
    optimizer counted in this launch (one line each); also the number of Muon layouts compared."""
    from titanlike.planner.layout import Layout as PlannedLayout
    from titanlike.planner.muon import muon_rank

    by_name = {layout.name: layout for layout in layouts}
    out, compared = [], 0
    for name, r in results["layouts"].items():
        if r.get("muon_stats") is None or r["mutation"]:
            continue
        cfg = config(by_name[name], world_size)
        args = model_args_from_config(cfg, vocab_size=VOCAB)
        planned = PlannedLayout.from_config(cfg, world_size, args, gpus_per_node=world_size)
        for rank, real in enumerate(r["muon_stats"]):
            p = muon_rank(planned, args, rank)
            predicted = tuple(getattr(p, k) for k in _MUON_COUNTS)
            if predicted != tuple(real[k] for k in _MUON_COUNTS):
                out.append(f"{name} rank {rank}: planned {predicted}, counted {tuple(real[k] for k in _MUON_COUNTS)}")
        compared += 1
    return out + [f"compared {compared}"]


def _expert_mesh(built: Built) -> list[str] | None:
    """The mesh dims of the first routed-expert weight (None: no experts, or not a DTensor)."""
    for part in built.model_parts:
        for name, p in part.named_parameters():
            if name.endswith(".experts.w1"):
                return list(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else None
    return None


def _counting_expert_comms(built: Built, counts: dict[str, int], on: bool) -> contextlib.AbstractContextManager:
    """Step 1 of a model with experts: every collective of the step (CommDebugMode, forward and backward) into
    ``counts``; a no-op otherwise."""
    # (not under a pipeline schedule: CommDebugMode's module tracker registers multi-grad hooks, which the stages'
    # autograd.grad backward refuses)
    # (nor on a model with MTP depths: they call the embedding and the head a second time in the forward, which
    # CommDebugMode's module tracker cannot follow, torch 2.13: IndexError in _fw_set_module_hook)
    # (nor under ring attention over MLA's latent: it calls the up-projection once per ring step, the same failure)
    from titanlike.parallel.ring_attention import RingLatentAttention

    mtp = any(len(getattr(m, "mtp", None) or ()) for m in built.model_parts)
    mtp = mtp or any(isinstance(x, RingLatentAttention) for m in built.model_parts for x in m.modules())
    if not on or mtp or built.step_kwargs.get("moe") is None or built.step_kwargs.get("pp_schedule") is not None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.debug import CommDebugMode

    @contextlib.contextmanager
    def counting():
        with CommDebugMode() as mode:
            yield
        counts.update({str(k): v for k, v in mode.get_comm_counts().items()})

    return counting()


def _zero1_report(optimizer, comms: dict[str, int], zero1: bool) -> dict | None:
    """ZeRO-1: the fraction of the moments' elements this rank holds, the parameters, the last step's collectives."""
    if not zero1:
        return None
    moments = [m for s in optimizer.state.values() for k, m in s.items() if k in ("exp_avg", "exp_avg_sq")]
    held = sum(m.to_local().numel() for m in moments) / sum(m.numel() for m in moments)
    params = sum(1 for g in optimizer.param_groups for p in g["params"] if p.ndim)
    return {"held": held, "params": params, "comms": dict(comms)}


def _count_optimizer_comms(optimizer, zero1: bool = False) -> dict[str, int]:
    """For Muon (an optimizer with ``stats``) and ZeRO-1: every collective of each ``step`` call, counted by
    CommDebugMode (the dict is refilled at each step, so after training it holds the last step's)."""
    counts: dict[str, int] = {}
    if getattr(optimizer, "stats", None) is None and not zero1:
        return counts
    from torch.distributed.tensor.debug import CommDebugMode

    original = optimizer.step

    def counted(*args, **kwargs):
        with CommDebugMode() as mode:
            out = original(*args, **kwargs)
        counts.clear()
        counts.update({str(k): v for k, v in mode.get_comm_counts().items()})
        return out

    optimizer.step = counted
    return counts


def gate_main(rank: int, world_size: int, out: str, only: list[str] | None = None) -> None:
    # full_tensor() of FSDP x TP parameters warns that it gathers one mesh dim at a time: expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ctx = Context(world_size)
    results = {}
    for layout in LAYOUTS:
        if layout.world_size != world_size or (only and layout.name not in only):
            continue
        results[layout.name] = run_layout(layout, ctx)
        if rank == 0:
            r = results[layout.name]
            print(
                f"[gate ws={world_size}] {layout.name:45s} ok={r['ok']!s:5} init {r['init']:.0e} "
                f"grad_placements {r['grad_placements']:.0f} "
                f"loss {r['loss']:.1e} "
                f"grad_norm {r['grad_norm']:.1e} grads {r['grads']:.1e} weights {r['weights']:.1e} "
                f"biases {r['biases']:.1e} eval {r['eval']:.1e} "
                f"({r['seconds']} s)",
                flush=True,
            )
    probes = {}
    if world_size == 4 and (not only or "fused_gqa tp2_fsdp2" in only):  # a user module's probe, sharing this launch
        from tp_probe_worker import probe_fused_gqa_fsdp

        t0 = time.perf_counter()
        probes["fused_gqa tp2_fsdp2"] = probe_fused_gqa_fsdp()
        if rank == 0:
            print(
                f"[gate ws={world_size}] fused_gqa tp2_fsdp2 (grouped-query fused q|k|v, tp-replicated) "
                f"train {probes['fused_gqa tp2_fsdp2']['train_diff']:.1e} ({time.perf_counter() - t0:.2f} s)",
                flush=True,
            )
    if rank == 0:
        Path(out).write_text(
            json.dumps({"world_size": world_size, "tolerance": TOL, "layouts": results, "probes": probes}, indent=1)
        )


def warm_hf_models(layouts: list[Layout], world_size: int, only: list[str] | None) -> None:
    """Before the ranks fork: import transformers and build what every rank would build alike for the transformers
    models of this launch (their config check, meta model, translated plan, init plan: cached per process), once."""
    keys = {
        lo.model
        for lo in layouts
        if lo.world_size == world_size and lo.model in HF_MODELS and (not only or lo.name in only)
    }
    if keys:
        from titanlike.models.transformers_lm import param_init, sharding_for

        for key in sorted(keys):
            args = model_args_from_config(config(Layout(key, 1, model=key), 1), vocab_size=VOCAB)
            sharding_for(args), param_init(args)


def main(argv: list[str] | None = None, entry=None, layouts: list[Layout] | None = None) -> int:
    """Command line of a gate worker; ``entry`` (default: this gate's ``gate_main``) runs on every rank over
    ``layouts`` (default: this gate's ``LAYOUTS``)."""
    from dist_utils import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--out", required=True, help="JSON file for the per-layout max differences")
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all of this world size)")
    ap.add_argument("--timeout", type=float, default=60.0, help="gloo timeout in seconds")
    a = ap.parse_args(argv)
    only = [s for s in a.only.split(",") if s] or None
    warm_hf_models(LAYOUTS if layouts is None else layouts, a.world_size, only)
    return spawn(entry or gate_main, a.world_size, a.out, only, timeout_s=a.timeout)


if __name__ == "__main__":
    sys.exit(main())
