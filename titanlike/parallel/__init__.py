"""Parallelism applied from outside to a plain model: device mesh, TP/SP, CP, vocab-parallel loss, FSDP2/HSDP, PP.

Public API (see docs/parallelism.md)::

    dims = ParallelDims.from_config(cfg, world_size)     # degrees, validated
    dims.build_mesh("cuda")                                # ("pp", "dp_replicate", "dp_shard", "cp", "tp") + derived
    model = parallelize_model(model, dims, cfg)            # TP(+SP) -> CP -> AC -> compile -> FSDP
    built = build_parallel_model(model, cfg, dims, device) # all of it (+ PP): parts, loss, clip, context
    loss_fn = build_loss_fn(cfg, dims)                     # vocab-parallel CE under TP
    norm = clip_grad_norm_(model.parameters(), max_norm)   # global norm over every mesh dim
    loss = ScaledLoss(sum_loss_fn)                         # train_step's loss: sum(loss) / global token count

The rank grid in pure Python (``rank_groups``, ``describe_layout``, ``MESH_DIMS``) comes from ``titanlike.layout``.
"""

from titanlike.layout import MESH_DIMS, describe_layout, rank_groups, rank_of
from titanlike.loss import ScaledLoss
from titanlike.parallel.activation_checkpoint import apply_ac
from titanlike.parallel.build import ParallelModel, build_parallel_model
from titanlike.parallel.clip import clip_grad_norm_, plain_clip_grad_norm_
from titanlike.parallel.compile import apply_compile
from titanlike.parallel.context_parallel import apply_cp, cp_shard
from titanlike.parallel.dims import ParallelDims
from titanlike.parallel.fsdp import apply_fsdp
from titanlike.parallel.fused import FusedColwiseParallel
from titanlike.parallel.loss_parallel import loss_parallel_cross_entropy, vocab_parallel_cross_entropy
from titanlike.parallel.materialize import to_empty_keeping_ties
from titanlike.parallel.parallelize import build_loss_fn, loss_group, loss_parallel_enabled, parallelize_model
from titanlike.parallel.pipeline import PipelineParallel, apply_pp, pipeline_module
from titanlike.parallel.tensor_parallel import (
    HeadNormParallel,
    PositionEmbeddingParallel,
    ReplicateParallel,
    apply_tp,
    tp_plan,
)

__all__ = [
    "MESH_DIMS",
    "ParallelDims",
    "FusedColwiseParallel",
    "HeadNormParallel",
    "ParallelModel",
    "PipelineParallel",
    "PositionEmbeddingParallel",
    "ReplicateParallel",
    "ScaledLoss",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "apply_pp",
    "apply_tp",
    "build_loss_fn",
    "build_parallel_model",
    "to_empty_keeping_ties",
    "clip_grad_norm_",
    "cp_shard",
    "describe_layout",
    "loss_parallel_cross_entropy",
    "loss_group",
    "loss_parallel_enabled",
    "pipeline_module",
    "parallelize_model",
    "plain_clip_grad_norm_",
    "rank_groups",
    "rank_of",
    "tp_plan",
    "vocab_parallel_cross_entropy",
]
