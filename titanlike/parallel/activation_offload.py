"""Activation offload (``activation_checkpoint.offload``): what a transformer block saves for its backward is copied
to host memory in the forward and back to the block's device when the backward unpacks it.

Per block, as activation checkpointing: a block's class is swapped in place for a subclass whose ``forward`` runs
under :func:`torch.autograd.graph.saved_tensors_hooks` with :func:`pack_to_host` / :func:`unpack_to_device`
(torch's :func:`~torch.autograd.graph.save_on_cpu`: pinned host memory and non-blocking copies on CUDA, so the
device-to-host copies overlap the forward; each tensor comes back when its backward node runs). Parameter names and
the module objects do not change.

With activation checkpointing: a checkpointed block saves only its inputs (full) or the outputs of its matmuls
(selective ``op``), and non-reentrant checkpointing keeps them in its own storage, outside these hooks; so offload
applies to the blocks AC leaves alone (with ``selective`` every-N: the other blocks) and a checkpointed block is left
as AC made it. Tensors saved as DTensors (tensor parallelism) are not offloaded here: the rule ``act_offload``
refuses ``offload`` with tp > 1.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from titanlike.models import block_container_of
from titanlike.parallel.activation_checkpoint import is_checkpointed

__all__ = ["apply_activation_offload", "is_offloaded", "pack_to_host", "unpack_to_device"]


def pack_to_host(tensor: torch.Tensor):
    """A host copy of a saved tensor (pinned when it lives on CUDA) and the device to bring it back to."""
    pin = tensor.device.type == "cuda" and not tensor.is_sparse
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
    host.copy_(tensor, non_blocking=pin)
    return tensor.device, host


def unpack_to_device(packed) -> torch.Tensor:
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


class _Offloaded:
    """Mixed into a block's class: ``forward`` saves its tensors for the backward in host memory."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved
            return super().forward(*args, **kwargs)
        # looked up at call time, so that a test can patch the module's functions
        with saved_tensors_hooks(_pack, _unpack):
            return super().forward(*args, **kwargs)


def _pack(tensor: torch.Tensor):
    return pack_to_host(tensor)


def _unpack(packed) -> torch.Tensor:
    return unpack_to_device(packed)


@functools.cache
def _offloaded_class(cls: type) -> type:
    return type(f"Offloaded{cls.__name__}", (_Offloaded, cls), {"__module__": cls.__module__})


def is_offloaded(module: nn.Module) -> bool:
    return isinstance(module, _Offloaded)


def apply_activation_offload(model: nn.Module) -> list[str]:
    """Offload the saved tensors of every block of ``model``'s block container that activation checkpointing left
    alone (apply AC first); return the offloaded blocks' names."""
    layers = block_container_of(model)
    if layers is None:
        raise ValueError(
            f"activation offload needs a model with a block container (its spec's, or .layers), got "
            f"{type(model).__name__}"
        )
    done = []
    for name, block in layers.named_children():
        if is_checkpointed(block) or is_offloaded(block):
            continue
        block.__class__ = _offloaded_class(type(block))
        done.append(name)
    return done
