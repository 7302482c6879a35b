"""ZeRO-1 (``parallelism.distributed_optimizer``, Megatron's ``--use-distributed-optimizer``): the parameters and
their gradients replicated over the data-parallel ranks, the optimizer state sharded over them.

Built from what is already there: the model is wrapped by FSDP2 over a replicate-only mesh (``data_parallel_
replicate_degree`` = dp, ``data_parallel_shard_degree`` = 1: gradients all-reduced, summed), so every parameter is a
DTensor replicated over ``dp_replicate``. :func:`shard_optimizer_state` creates AdamW's moments (``exp_avg``,
``exp_avg_sq``) as DTensors sharded on dim 0 over that mesh dimension before the first step, and gives the optimizer
a ``step`` that updates each rank's rows only and then all-gathers the parameter, Megatron's way: torch's own AdamW
(foreach or for-loop) runs on views of this rank's rows of every parameter and gradient (DTensors sharded as the
moments: every operand local, no communication), writing into the parameter's local tensor, then each parameter is
all-gathered from its updated shards (one all-gather of its size) and copied into place. Exact: every element is
computed as on one device. 0-d parameters keep replicated moments and a replicated update.

Per step: one all-reduce of the gradients (FSDP) and one all-gather of the parameters' size (the optimizer). The
optimizer state per rank is 1/dp of the replicated one. Gradient clipping (the global norm of the replicated
gradients), the LR schedule (the optimizer's own ``param_groups``) and DCP checkpoints (the moments are DTensors:
saved by their global shape, loaded into any layout; the optimizer's state stays keyed by the parameters between
steps) work as for FSDP.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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


def _row_views(p: DTensor, moment: DTensor) -> tuple[DTensor, DTensor]:
    """This rank's rows of the replicated parameter ``p`` and of its gradient, as DTensors placed as ``moment`` (its
    sharded exp_avg): views into their local tensors (which hold the whole parameter), so that an in-place update
    lands in the parameter."""
    shape, offset = compute_local_shape_and_global_offset(moment.shape, moment.device_mesh, moment.placements)
    views = []
    for t in (p, p.grad):
        local = t._local_tensor.narrow(0, offset[0], shape[0])
        views.append(
            DTensor.from_local(
                local, moment.device_mesh, moment.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        )
    return views[0], views[1]


class _ShardedUpdate:
    """Mixed into the optimizer's class: ``step`` updates this rank's rows of each parameter and all-gathers it."""

    @torch.no_grad()
    def step(self, closure=None):
        swapped = []  # (group, index, parameter, its rows)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.ndim == 0 or p.grad is None:
                    continue
                rows, grad_rows = _row_views(p, self.state[p]["exp_avg"])
                rows.grad = grad_rows
                self.state[rows] = self.state.pop(p)
                group["params"][i] = rows
                swapped.append((group, i, p, rows))
        try:
            out = super().step(closure)
        finally:
            for group, i, p, rows in swapped:
                group["params"][i] = p
                self.state[p] = self.state.pop(rows)
        for _, _, p, rows in swapped:
            _all_gather_into(p, rows)
        return out


def _all_gather_into(p: DTensor, rows: DTensor) -> None:
    """``p``'s local tensor from every rank's updated rows: one all-gather of ``p``'s size."""
    p._local_tensor.copy_(rows.redistribute(p.device_mesh, p.placements).to_local())


@functools.cache
def _sharded_update_class(cls: type) -> type:
    return type(f"ZeRO1{cls.__name__}", (_ShardedUpdate, cls), {"__module__": cls.__module__})


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh_dim: int = 0) -> torch.optim.Optimizer:
    """Create ``optimizer``'s (an AdamW's, foreach or for-loop) state with the moments sharded on dim 0 over mesh
    dimension ``mesh_dim`` of the parameters' mesh (the replicated data-parallel dimension); 0-d parameters keep
    replicated moments. Its ``step`` then updates this rank's rows and all-gathers each parameter (the class is
    swapped in place for a subclass). Call before the first step and before a checkpoint load; returns
    ``optimizer``."""
    if not isinstance(optimizer, torch.optim.AdamW) or any(g.get("fused") for g in optimizer.param_groups):
        raise ValueError("distributed optimizer: AdamW with the foreach or for-loop implementation only")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                raise ValueError("distributed optimizer: the parameters must be DTensors (FSDP over dp_replicate)")
            if p.to_local().shape != p.shape:
                raise ValueError(
                    f"distributed optimizer: a parameter placed {p.placements} is sharded; ZeRO-1 needs every "
                    f"parameter whole on every rank (data_parallel_shard_degree 1, no tensor parallelism)"
                )
            placements = _sharded_placements(p, mesh_dim) if p.ndim else list(p.placements)
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            for name in MOMENTS:
                state[name] = dtensor_zeros(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=placements)
    if not isinstance(optimizer, _ShardedUpdate):
        optimizer.__class__ = _sharded_update_class(type(optimizer))
    return optimizer
