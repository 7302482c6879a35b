"""FSDP2 (``fully_shard``) and HSDP over the data-parallel mesh, composing with tensor parallelism.

Groups, in order: every transformer block, then the token embedding, then the final norm + output head
together, then the root (whatever is left: rotary buffers need nothing; a tied embedding/head weight is left
to the root so that ONE group owns it). Each group all-gathers its parameters in one collective before its
forward and reduce-scatters its gradients in one collective after its backward.

* A 1-D ``dp_mesh`` shards parameters over all its ranks (FSDP); a 2-D ``("dp_replicate", "dp_shard_cp")``
  mesh shards over the second dim and replicates over the first (HSDP: reduce-scatter, then all-reduce).
* Parameters that are already DTensors (tensor parallelism) get a 2-D layout ``(dp..., tp)``.
* Gradients are **summed** over the data-parallel ranks, never averaged: the loss is already divided by the
  global token count (``titanlike.training.step``), so averaging would divide by the dp degree twice.
* ``reshard_after_forward``: ``"always"`` frees gathered parameters after each group's forward and gathers
  them again in the backward (less memory, more communication); ``"never"`` keeps them; ``"default"`` is
  decided per group by ``titanlike.layout.reshard_after_forward`` (the planner prices the same answer).
* ``param_dtype`` / ``reduce_dtype``: FSDP's mixed precision (bf16 compute copies of fp32 master
  parameters, fp32 gradient reduction); ``None`` keeps the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titanlike.layout import RESHARD_CHOICES
from titanlike.layout import reshard_after_forward as reshard_policy

__all__ = ["apply_fsdp", "RESHARD_CHOICES"]


def _sum_gradients(module: FSDPModule) -> None:
    """Reduce gradients with SUM (divide factor 1, no AVG / PREMUL_SUM ops: gloo has no PREMUL_SUM)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def _tied_head(model: nn.Module) -> bool:
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return emb is not None and out is not None and out.weight is emb.weight


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: str = "default",
    pp_enabled: bool = False,
    blocks: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``dp_mesh`` (1-D: FSDP, 2-D: HSDP); return it.

    ``blocks`` are the modules that get their own group (default: ``model.layers``' children, if any); the
    Llama embedding and norm + head get theirs when present; the root takes the rest. Works on the meta device.
    """
    if reshard_after_forward not in RESHARD_CHOICES:
        raise ValueError(f"reshard_after_forward must be one of {RESHARD_CHOICES}, got {reshard_after_forward!r}")
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D (FSDP) or 2-D (HSDP: replicate, shard) mesh, got {dp_mesh}")
    def reshard(group: str) -> bool:
        return reshard_policy(reshard_after_forward, group, pp_enabled)

    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if blocks is None:
        layers = getattr(model, "layers", None)
        blocks = list(layers.children()) if isinstance(layers, nn.Module) else []
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard("block"), **kw)
    if not _tied_head(model):
        if getattr(model, "tok_embeddings", None) is not None:
            fully_shard(model.tok_embeddings, reshard_after_forward=reshard("embedding"), **kw)
        head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
        if head:
            fully_shard(head, reshard_after_forward=reshard("head"), **kw)
    fully_shard(model, reshard_after_forward=reshard("root"), **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            _sum_gradients(m)
    return model
