"""Global gradient-norm clipping over DTensor gradients and pipeline stages.

The norm is taken over every parameter of the *whole* model, identical on every rank:

* gradients are grouped by (mesh, placements); each group's norm is a DTensor reduction whose
  ``full_tensor()`` combines the shards over every mesh dim they are sharded on (tp, dp, both), while
  replicated dims are counted once: one small all-reduce per group, a handful per model;
* plain-tensor gradients (a rank's own parameters, e.g. replicated norm weights under TP without SP) count as
  they are;
* with pipeline parallelism each stage holds different parameters: the squared norms are summed over
  ``pp_group`` (:func:`reduce_across_stages`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "grad_norm_squared", "reduce_across_stages"]


def _groups(params: list[Tensor]) -> list[list[Tensor]]:
    """Parameters with gradients, grouped by the gradient's (mesh, placements), in first-seen order."""
    groups: dict[object, list[Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def grad_norm_squared(groups: list[list[Tensor]], device: torch.device, foreach: bool | None = None) -> Tensor:
    """Sum of squared gradient entries of this pipeline stage (every shard counted once), a float64 plain tensor
    (one dtype on every stage, whatever the gradients' dtypes, for the cross-stage all-reduce)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.to(torch.float64) ** 2
    return total


def reduce_across_stages(norm_sq: Tensor, pp_group) -> Tensor:
    """Sum the squared norms of the pipeline stages (each stage holds different parameters)."""
    dist.all_reduce(norm_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return norm_sq


def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor,
    max_norm: float,
    pp_group=None,
    *,
    norm_parameters: Iterable[Tensor] | None = None,
    foreach: bool | None = None,
) -> Tensor:
    """Global L2 norm (float64) of the gradients before clipping, identical on every rank; scales the gradients
    of ``parameters`` in place by ``max_norm / (norm + 1e-6)`` when that is below 1 and ``max_norm > 0``.

    ``norm_parameters`` (default: ``parameters``) are the ones whose gradients make up the norm, e.g. without a
    pipeline stage's second copy of a tied weight. Collective: every rank of every mesh the gradients live on
    (and of ``pp_group``) must call it, with the same parameters as the other ranks of those meshes.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    counted = params if norm_parameters is None else list(norm_parameters)
    device = params[0].device if params else torch.device("cpu")
    norm_sq = grad_norm_squared(_groups([p for p in counted if p.grad is not None]), device, foreach)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        norm_sq = reduce_across_stages(norm_sq, pp_group)
    total = norm_sq.sqrt()
    if max_norm > 0:
        for group in _groups([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
