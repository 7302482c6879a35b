"""``DTensor.from_local`` with the gradient placement chosen by the caller, on every supported torch.

torch 2.13 has ``DTensor.from_local(..., grad_placements=...)``; torch 2.11 does not (a ``TypeError``), and its
backward redistributes the gradient to the forward placements, so a ``Replicate`` DTensor whose consumers give it a
``Partial`` gradient (each tp rank's heads use all of MLA's latent) would be all-reduced there, once too often.
:func:`from_local` is the one way titanlike builds such a DTensor: forward, ``DTensor.from_local`` of the local
tensor; backward, the gradient redistributed to ``grad_placements`` and handed back as its local tensor (what
torch 2.13 does with ``grad_placements``); where torch has ``grad_placements``, its own ``from_local`` with them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

__all__ = ["from_local"]


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, placements, grad_placements):  # type: ignore[override]
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        return DTensor.from_local(local, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None, None
        if tuple(grad.placements) != ctx.grad_placements:
            grad = grad.redistribute(ctx.mesh, ctx.grad_placements)
        return grad.to_local(), None, None, None


# torch's own ``grad_placements`` where it has one: dynamo traces it (a compiled block), whereas the fallback's
# backward, traced, may not redistribute a Replicate gradient to Partial ("for internal use only")
_NATIVE = "grad_placements" in inspect.signature(DTensor.from_local).parameters


def from_local(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], grad_placements: Sequence[Placement]
) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False)`` whose gradient reaches ``local`` as the local
    tensor of its ``grad_placements`` layout (e.g. ``Partial``: each rank's own part, not summed)."""
    if _NATIVE:
        return DTensor.from_local(
            local, mesh, tuple(placements), run_check=False, grad_placements=tuple(grad_placements)
        )
    return _FromLocal.apply(local, mesh, tuple(placements), tuple(grad_placements))
