"""ZeRO-1 (``parallelism.distributed_optimizer``, Megatron's ``--use-distributed-optimizer``): the parameters and
their gradients replicated over the data-parallel ranks, the optimizer state sharded over them.

Built from what is already there: the model is wrapped by FSDP2 over a replicate-only mesh (``data_parallel_
replicate_degree`` = dp, ``data_parallel_shard_degree`` = 1: gradients all-reduced, summed), so every parameter is a
DTensor replicated over ``dp_replicate``. :func:`shard_optimizer_state` then creates AdamW's moments
(``exp_avg``, ``exp_avg_sq``) as DTensors sharded on dim 0 over that mesh dimension before the first step. torch's
own AdamW (foreach) runs on them unchanged, and DTensor's sharding propagation does the rest: each rank updates the
moments of its rows only (the replicated gradient's slice is local, no communication), and the in-place update of
the replicated parameter all-gathers the two sharded operands (``exp_avg`` and the denominator), so every rank
applies the same full update. Exact: every element is computed as on one device.

Per step: one all-reduce of the gradients (FSDP) and two all-gathers of the parameters' size (the optimizer). The
optimizer state per rank is 1/dp of the replicated one. Gradient clipping (the global norm of the replicated
gradients), the LR schedule (the optimizer's own ``param_groups``) and DCP checkpoints (the moments are DTensors:
saved by their global shape, loaded into any layout) work as for FSDP.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import zeros as dtensor_zeros

__all__ = ["shard_optimizer_state", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state


def _sharded_placements(p: DTensor, mesh_dim: int) -> list:
    placements = list(p.placements)
    if not isinstance(placements[mesh_dim], Replicate):
        raise ValueError(
            f"distributed optimizer: a parameter placed {p.placements} is not replicated over mesh dim {mesh_dim}"
        )
    placements[mesh_dim] = Shard(0)
    return placements


def _step_dtype() -> torch.dtype:
    """AdamW's own dtype for its (CPU) step count."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh_dim: int = 0) -> torch.optim.Optimizer:
    """Create ``optimizer``'s (an AdamW's, foreach or for-loop) state with the moments sharded on dim 0 over mesh
    dimension ``mesh_dim`` of the parameters' mesh (the replicated data-parallel dimension); 0-d parameters keep
    replicated moments. Call before the first step and before a checkpoint load; returns ``optimizer``."""
    if not isinstance(optimizer, torch.optim.AdamW) or any(g.get("fused") for g in optimizer.param_groups):
        raise ValueError("distributed optimizer: AdamW with the foreach or for-loop implementation only")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                raise ValueError("distributed optimizer: the parameters must be DTensors (FSDP over dp_replicate)")
            placements = _sharded_placements(p, mesh_dim) if p.ndim else list(p.placements)
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            for name in MOMENTS:
                state[name] = dtensor_zeros(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=placements)
    return optimizer
