"""Parallelism applied from outside to a plain model: device mesh, TP/SP, vocab-parallel loss, FSDP2/HSDP.

Public API (see docs/parallelism.md)::

    dims = ParallelDims.from_config(cfg, world_size)     # degrees, validated
    mesh = dims.build_mesh("cuda")                         # ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    model = parallelize_model(model, dims, mesh, cfg)      # TP(+SP) -> AC -> compile -> FSDP
    loss_fn = build_loss_fn(cfg, dims, mesh)               # vocab-parallel CE under TP
    norm = clip_grad_norm_(model.parameters(), max_norm)   # global norm over every mesh dim

Submodules are imported lazily, so ``import titanlike.parallel`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelDims": "dims", "describe_layout": "dims", "rank_groups": "dims", "rank_of": "dims",
    "MESH_DIMS": "dims",
    "tp_plan": "tensor_parallel", "apply_tp": "tensor_parallel", "ReplicateParallel": "tensor_parallel",
    "apply_fsdp": "fsdp",
    "clip_grad_norm_": "clip",
    "parallelize_model": "parallelize", "build_loss_fn": "parallelize", "loss_parallel_enabled": "parallelize",
    "loss_group": "parallelize", "apply_cp": "context_parallel", "cp_shard": "context_parallel",
    "loss_parallel_cross_entropy": "loss_parallel", "vocab_parallel_cross_entropy": "loss_parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
