"""Data-parallel coverage: with more than one data-parallel rank, every trainable parameter's gradient must be reduced
over those ranks, or each rank steps its own copy with its own part of the batch and the copies drift apart (issue
26: ``apply_fsdp(model.model)`` leaves the head outside, a plain tensor whose gradient nobody sums: grad norm off by
0.35, no error).

A parameter is covered when it is a DTensor whose mesh spans every rank of the data-parallel group (FSDP / HSDP put
the dp dims into every parameter's mesh), or when it lies in a module under an explicit replicate group (torch's
``DistributedDataParallel`` or composable ``replicate``). ``train_step`` runs :func:`check_dp_coverage` on its first
step (it is the one call every training loop makes, after whatever parallelized the model, on the root of each
part: ``apply_fsdp`` only sees the module it is given), before any forward; one line names every parameter left
out and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["check_dp_coverage", "uncovered_parameters"]


def _replicated_modules(part: nn.Module) -> list[str]:
    """Prefixes of the modules under an explicit replicate group (DDP or composable ``replicate``)."""
    from torch.distributed._composable.contract import _get_registry

    prefixes = []
    for name, m in part.named_modules():
        if isinstance(m, nn.parallel.DistributedDataParallel) or "replicate" in (_get_registry(m) or {}):
            prefixes.append(name)
    return prefixes


def uncovered_parameters(model_parts: Sequence[nn.Module], dp_ranks: Sequence[int]) -> list[str]:
    """Names of the trainable parameters of ``model_parts`` no data-parallel reduction over ``dp_ranks`` covers."""
    need = set(dp_ranks)
    out = []
    for part in model_parts:
        replicated = _replicated_modules(part)
        for name, p in part.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            if isinstance(p, DTensor) and need <= set(p.device_mesh.mesh.flatten().tolist()):
                continue
            if any(name.startswith(f"{r}.") or r == "" for r in replicated):
                continue
            out.append(name)
    return out


def _by_pattern(names: list[str]) -> list[str]:
    """Every name, those that differ only in their indices as one pattern with a count (``h.*.fc.weight (x4)``)."""
    counts: dict[str, int] = {}
    for name in names:
        key = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
        counts[key] = counts.get(key, 0) + 1
    return [k if n == 1 else f"{k} (x{n})" for k, n in counts.items()]


def check_dp_coverage(model_parts: Sequence[nn.Module], dp_group) -> None:
    """Refuse, in one line naming them all, trainable parameters that no reduction over ``dp_group`` covers (a
    group of one rank, or None: nothing to cover). Checked once per (part, group)."""
    if dp_group is None or dist.get_world_size(dp_group) < 2:
        return
    todo = [m for m in model_parts if getattr(m, "_titanlike_dp_covered", None) is not dp_group]
    if not todo:
        return
    ranks = dist.get_process_group_ranks(dp_group)
    left = uncovered_parameters(todo, ranks)
    if left:
        shown = ", ".join(_by_pattern(left))
        raise ValueError(
            f"data parallel over {len(ranks)} ranks, but no data-parallel reduction covers the trainable "
            f"parameter(s) {shown}: their gradients would never be summed over the dp ranks; apply_fsdp to the "
            f"root module (apply_fsdp(model, dp_mesh, blocks=[...]): the root group takes what the blocks leave), "
            f"or put them under a DTensor over the dp mesh / torch's replicate()"
        )
    for m in todo:
        m._titanlike_dp_covered = dp_group
