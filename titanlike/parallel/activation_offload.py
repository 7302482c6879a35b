"""Activation offload (``activation_checkpoint.offload``): what a transformer block saves for its backward is copied
to host memory in the forward and prefetched back to the device for the backward, one block ahead.

Per block, as activation checkpointing: a block's class is swapped in place for a subclass whose ``forward`` runs
under :func:`torch.autograd.graph.saved_tensors_hooks` with :func:`pack_to_host` / :func:`unpack_to_device`.
Parameter names and the module objects do not change.

- **Forward**: each saved tensor is copied to host memory (pinned, non-blocking on CUDA: the host does not wait for
  the copy) and filed under the block's *record* (one per block per forward, so every microbatch has its own); the
  record points back at the record of the offloaded block that ran before it in the same forward. Parameters (the
  weights a matmul saves) are kept as they are, as torchtitan and Megatron do: they stay on the device anyway.
- **Backward**: a hook on the block's output gradient fires when the backward reaches block ``i``, before any of
  its backward ops run. It brings back block ``i``'s record (already done by block ``i + 1``'s hook, unless ``i`` is
  the last block) and the previous block's, ``i - 1``, which the backward runs next: on CUDA the host-to-device
  copies run on a side stream (one per device, after the compute stream's work so far) and end with an event; on
  any other device they are done at once. A record's host copies are released as soon as they are brought back
  (on CUDA the pinned-memory allocator keeps a buffer until its copy is done). The unpack then finds its tensor on
  the device: on CUDA the compute stream waits on the record's event (and the tensor is marked used by it), so
  the copies of block ``i - 1`` overlap block ``i``'s backward. A tensor whose record no hook brought back (an
  output that does not require grad) is copied back by its unpack, on the compute stream, as before.

The device holds at most two blocks' saved tensors in the backward (the one running and the one prefetched). A
saved tensor unpacked twice (a backward with ``retain_graph``, split-backward pipeline schedules) gets the same
device tensor again; it is freed with the autograd node that saved it.

Not :func:`torch.autograd.graph.save_on_cpu`: its unpack copies each tensor back when its own backward node runs
(every host-to-device copy on the backward's critical path), and it has no hand to bring a whole block back ahead.

With activation checkpointing: a checkpointed block saves only its inputs (full) or the outputs of its matmuls
(selective ``op``), and non-reentrant checkpointing keeps them in its own storage, outside these hooks; so offload
applies to the blocks AC leaves alone (with ``selective`` every-N: the other blocks) and a checkpointed block is left
as AC made it; the previous offloaded block in the forward is then the one before the checkpointed ones. Tensors
saved as DTensors (tensor parallelism) are not offloaded here: the rule ``act_offload`` refuses ``offload`` with
tp > 1.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from titanlike.models import block_container_of
from titanlike.parallel.activation_checkpoint import is_checkpointed

__all__ = ["apply_activation_offload", "is_offloaded", "pack_to_host", "unpack_to_device"]


class _Saved:
    """One saved tensor: its host copy until brought back, then its device copy (and, on CUDA, the event its copy
    ends with until the compute stream has waited on it)."""

    __slots__ = ("block", "device", "host", "on_device", "event")

    def __init__(self, block: str, device: torch.device, host: torch.Tensor):
        self.block = block
        self.device = device
        self.host = host
        self.on_device: torch.Tensor | None = None
        self.event = None

    def bring_back(self) -> None:
        """Copy the host tensor to the device (on the current stream; non-blocking from pinned memory) and release
        the host copy. A real copy on every device, the CPU included."""
        if self.on_device is None:
            host, self.host = self.host, None
            self.on_device = host.to(self.device, non_blocking=host.is_pinned(), copy=True)


class _Record:
    """The tensors one block saved in one forward, and the record of the offloaded block before it."""

    __slots__ = ("block", "index", "saved", "prev", "fetched", "__weakref__")

    def __init__(self, block: str, index: int, prev: _Record | None):
        self.block = block
        self.index = index
        self.saved: list[_Saved] = []
        self.prev = prev
        self.fetched = False


class _Chain:
    """Shared by the offloaded blocks of one block container: the record of the last offloaded block that ran a
    forward (a weak reference: the autograd graph owns the records)."""

    def __init__(self):
        self.last = None

    def start(self, block: str, index: int) -> _Record:
        last = self.last() if self.last is not None else None
        # a block at or before the last one starts a new forward (the next microbatch, step or evaluation)
        rec = _Record(block, index, last if last is not None and last.index < index else None)
        self.last = weakref.ref(rec)
        return rec


_current: list[_Record] = []  # the record of the block whose forward is running (innermost last)
_streams: dict[torch.device, torch.cuda.Stream] = {}


def pack_to_host(tensor: torch.Tensor) -> _Saved | torch.Tensor:
    """A host copy of a saved tensor (pinned when it lives on CUDA), filed under the running block's record; a
    parameter (a weight a matmul saves) is kept as it is: it stays on the device anyway (FSDP frees and gathers its
    unsharded copy itself)."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    pin = tensor.device.type == "cuda" and not tensor.is_sparse
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
    host.copy_(tensor, non_blocking=pin)
    rec = _current[-1] if _current else None
    saved = _Saved(rec.block if rec is not None else "", tensor.device, host)
    if rec is not None:
        rec.saved.append(saved)
    return saved


def unpack_to_device(saved: _Saved | torch.Tensor) -> torch.Tensor:
    """The device tensor of ``saved``: the one its block's prefetch brought back (the compute stream waits on its
    copy), or a copy made now when no prefetch reached it (a parameter: itself)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if saved.on_device is None:
        saved.bring_back()
    elif saved.event is not None:
        stream = torch.cuda.current_stream(saved.on_device.device)
        stream.wait_event(saved.event)
        saved.on_device.record_stream(stream)
        saved.event = None
    return saved.on_device


def _fetch(rec: _Record) -> None:
    """Bring ``rec``'s tensors back to the device ahead of their unpack and release their host copies: on CUDA on
    the device's side stream (after the compute stream's work so far), ending with one event; elsewhere at once."""
    rec.fetched = True
    saved, rec.saved = rec.saved, []
    on_cuda: dict[torch.device, list[_Saved]] = {}
    for s in saved:
        if s.device.type == "cuda":
            on_cuda.setdefault(s.device, []).append(s)
        else:
            s.bring_back()
    for device, group in on_cuda.items():
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for s in group:
                s.bring_back()
        event = stream.record_event()
        for s in group:
            s.event = event


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def _on_output_grad(rec: _Record):
    """The hook on a block's output gradient: the backward reaches the block; bring back its record (unless the
    next block's hook did) and the previous block's, which the backward runs next."""

    def hook(grad):
        for r in (rec, rec.prev):
            if r is not None and not r.fetched:
                _fetch(r)

    return hook


class _Offloaded:
    """Mixed into a block's class: ``forward`` saves its tensors for the backward in host memory, and its output's
    gradient brings them (and the previous block's) back."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved
            return super().forward(*args, **kwargs)
        rec = self._offload_chain.start(self._offload_name, self._offload_index)
        _current.append(rec)
        try:
            # looked up at call time, so that a test can patch the module's functions
            with saved_tensors_hooks(_pack, _unpack):
                out = super().forward(*args, **kwargs)
        finally:
            _current.pop()
        hook = _on_output_grad(rec)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
        return out


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
    alone (apply AC first), each block's brought back when the backward reaches the block after it; return the
    offloaded blocks' names."""
    layers = block_container_of(model)
    if layers is None:
        raise ValueError(
            f"activation offload needs a model with a block container (its spec's, or .layers), got "
            f"{type(model).__name__}"
        )
    chain = _Chain()
    done = []
    for index, (name, block) in enumerate(layers.named_children()):
        if is_checkpointed(block) or is_offloaded(block):
            continue
        block._offload_chain, block._offload_name, block._offload_index = chain, name, index
        block.__class__ = _offloaded_class(type(block))
        done.append(name)
    return done
