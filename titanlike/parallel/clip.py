"""Global gradient-norm clipping over DTensor gradients and pipeline stages.

The norm is taken over every parameter of the *whole* model, identical on every rank:

* each rank squares its local shards; a shard replicated over mesh dims of total size R (e.g. a norm weight on
  the tp dim) is weighted 1/R, so that summing over all the ranks of the mesh counts every entry once;
* those sums are all-reduced over each dim of the gradients' mesh, one scalar all-reduce per mesh dim (a
  DTensor ``full_tensor()`` of each parameter group's norm gives the same number with more collectives);
* ``Partial`` gradients (not produced by ``apply_tp`` / ``apply_fsdp``) are reduced first;
* plain-tensor gradients (a rank's own parameters, replicated or pipeline-stage local) count as they are;
* with pipeline parallelism each stage holds different parameters: the squared norms are summed over
  ``pp_group`` (:func:`reduce_across_stages`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "grad_norm_squared", "plain_clip_grad_norm_", "reduce_across_stages"]


def plain_clip_grad_norm_(parameters, max_norm: float) -> Tensor:
    """Gradient clipping for a model without DTensor parameters or pipeline stages (one process)."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _groups(params: list[Tensor]) -> list[list[Tensor]]:
    """Parameters with gradients, grouped by the gradient's (mesh, placements), in first-seen order."""
    groups: dict[object, list[Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def grad_norm_squared(groups: list[list[Tensor]], device: torch.device, foreach: bool | None = None) -> Tensor:
    """Sum of squared gradient entries of this pipeline stage (every entry counted once), a float64 plain tensor
    identical on the ranks of the gradients' meshes (one dtype on every stage, for the cross-stage all-reduce)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    per_mesh: dict[object, Tensor] = {}  # mesh -> this rank's weighted local sum, reduced below
    for params in groups:
        grads = [p.grad for p in params]
        if not isinstance(grads[0], DTensor):
            total = total + torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach).to(torch.float64) ** 2
            continue
        mesh, placements = grads[0].device_mesh, grads[0].placements
        if any(pl.is_partial() for pl in placements):
            placements = [Replicate() if pl.is_partial() else pl for pl in placements]
            grads = [g.redistribute(mesh, placements) for g in grads]
        replicas = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_replicate())
        local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], 2.0, foreach=foreach)
        per_mesh[mesh] = per_mesh.get(mesh, 0) + local.to(torch.float64) ** 2 / replicas
    for mesh, local_sq in per_mesh.items():
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(local_sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + local_sq
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
        # torch.nn.utils.clip_grads_with_norm_'s arithmetic, with the (float64) coefficient cast once per group to
        # the gradients' dtype: handed the float64 coefficient, _foreach_mul_ falls back to one dtype-converting
        # mul_ per gradient (20 extra copies per step on a 2-layer model: the overhead a CPU profile of the
        # benchmark showed). The product is the same: mul_ casts a 0-dim coefficient to the gradient's dtype.
        # (float32/float64 only: for bf16/fp16 gradients mul_ keeps the coefficient in float32, so those take
        # torch's own path.)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in _groups([p for p in params if p.grad is not None]):
            grads = [p.grad for p in group]
            if grads[0].dtype not in (torch.float32, torch.float64):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
                continue
            c = coef.to(device=grads[0].device, dtype=grads[0].dtype)
            if foreach is False:
                for g in grads:
                    g.mul_(c)
            else:
                torch._foreach_mul_(grads, c)
    return total
