"""Count the device-to-host reads of a block of code: ``with count_host_reads() as reads: ...``.

A read of a device value on the host (``loss.item()``, ``if (x > 0).any():``, ``t.tolist()``, a shape that depends on
the data) waits for every queued kernel: the GPU's queue drains, and a step that reads cannot be captured as a CUDA
graph. On a CPU nothing waits, so the reads are invisible there; this counter records them anyway, each with the kind
of read and where it came from (the innermost frame outside torch: titanlike's or your own file:line) and the
trainer's phase (``titanlike.hang``), so a step's budget can be asserted on a CPU machine.

What is recorded:

* ``item``: ``aten._local_scalar_dense``: ``t.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:`` (not
  torch.optim's read of its own step count, a host tensor by design unless ``capturable``, nor a tensor marked with
  :func:`on_the_host`);
* ``data-dependent shape``: ``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing and ``repeat_interleave``
  without ``output_size`` (their output's size is read from the device);
* ``tolist`` / ``cpu`` / ``numpy``: the methods themselves (on a CPU they copy nothing, so they are intercepted
  explicitly; ``.cpu()`` of a tensor already on the host counts too: on a GPU it would be a transfer);
* ``object collective``: ``all_gather_object``, ``broadcast_object_list``, ``gather_object``,
  ``scatter_object_list`` (they pickle through the host);
* ``split sizes``: ``all_to_all_single`` (``torch.distributed``'s or the functional collectives', autograd too) given
  its split sizes as Python lists (the shapes of an uneven exchange
  known on the host: the sizes were read from a tensor, counted where they were read, and the collective is named).

The recording runs under a ``TorchDispatchMode``, which sees the ops of DTensor, FSDP and the pipeline schedules too
(their local ops run below the mode). Reads nested inside a recorded one (``tolist`` inside ``all_gather_object``,
``item`` inside ``tolist``) count once, as the outer one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SCALAR = {_aten._local_scalar_dense.default}
_DATA_SHAPED = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
_METHODS = ("tolist", "cpu", "numpy")
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_STDLIB = os.path.dirname(contextlib.__file__) + os.sep


@dataclass(frozen=True)
class HostRead:
    kind: str  # item, data-dependent shape, tolist, cpu, numpy, object collective, split sizes
    op: str  # the op or function: aten._local_scalar_dense, Tensor.tolist, all_gather_object, ...
    where: str  # file:line of the innermost frame outside torch and the standard library (function name after)
    phase: str = ""  # the trainer's phase and module at the read (titanlike.hang), when one is set

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}" + (f" [{self.phase}]" if self.phase else "")


@dataclass
class HostReads:
    """The reads recorded so far (``reads``), in order; ``mark()`` / ``since(mark)`` take those of a stretch."""

    reads: list[HostRead] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reads)

    def mark(self) -> int:
        return len(self.reads)

    def since(self, mark: int) -> list[HostRead]:
        return self.reads[mark:]

    def summary(self, reads: list[HostRead] | None = None) -> str:
        """One line per distinct read: its count and what it is."""
        counts = Counter(str(r) for r in (self.reads if reads is None else reads))
        return "\n".join(f"{n:4d} x {what}" for what, n in counts.most_common()) or "no host reads"


class _State(threading.local):
    depth = 0  # > 0 inside a recorded read: nested reads are part of it


_STATE = _State()


def _where() -> str:
    """file:line (function) of the innermost frame outside torch, the standard library and this file."""
    f = sys._getframe(1)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not (name.startswith(_TORCH_DIR) or name.startswith(_STDLIB) or name == _THIS_FILE):
            return (
                f"{os.path.relpath(name) if name.startswith(os.getcwd()) else name}:{f.f_lineno} ({f.f_code.co_name})"
            )
        f = f.f_back
    return "?"


def _optimizer_step_count(t: torch.Tensor) -> bool:
    """A non-capturable torch.optim optimizer reading its step count: that count lives on the host by design (with
    parameters on a GPU too), so the read waits for nothing."""
    if t.device.type != "cpu" or t.dim() != 0:
        return False
    f = sys._getframe(1)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if name.startswith(_TORCH_DIR + "optim" + os.sep):
            return True
        if not (name.startswith(_TORCH_DIR) or name == _THIS_FILE):
            return False
        f = f.f_back
    return False


def _phase() -> str:
    from titanlike import hang

    w = hang.WHERE
    return f"{w.phase}{' ' + w.module if w.module else ''}" if w.phase not in ("start", "") else ""


def on_the_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a host tensor by design (a CPU tensor also when the model runs on a GPU: a flag all-reduced on
    gloo): reading it waits for no device work, so the counter does not record its reads. Returns ``t``."""
    t._titanlike_on_the_host = True
    return t


def _host_by_design(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_titanlike_on_the_host", False)


class _Mode(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SCALAR and not (_host_by_design(args[0]) or _optimizer_step_count(args[0])):
            self.record("item", "aten._local_scalar_dense")
        elif func in _DATA_SHAPED or (func is _aten.repeat_interleave.Tensor and not (kwargs or {}).get("output_size")):
            self.record("data-dependent shape", f"aten.{func.__name__}")
        elif func is _aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self.record("data-dependent shape", "aten.index (boolean mask)")
        _STATE.depth += 1  # reads inside the op (DTensor's local op of the same item) are part of this one
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _STATE.depth -= 1


def _wrap(original, record, kind: str, op: str, check=None):
    def wrapper(*args, **kwargs):
        if (check is None or check(*args, **kwargs)) and not (args and _host_by_design(args[0])):
            record(kind, op)
        _STATE.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _STATE.depth -= 1

    wrapper.__wrapped__ = original
    return wrapper


def _list_splits(*args, **kwargs) -> bool:
    splits = list(args[2:4]) + [kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes")]
    return any(isinstance(s, list | tuple) for s in splits)


def _funcol_list_splits(*args, **kwargs) -> bool:
    splits = list(args[1:3]) + [kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes")]
    return any(isinstance(s, list | tuple) for s in splits)


@contextlib.contextmanager
def _patched(record) -> Iterator[None]:
    """Tensor.tolist / cpu / numpy and the object collectives (which the dispatch mode cannot see as reads)."""
    saved = []

    def patch(owner, name, kind, op, check=None):
        original = getattr(owner, name, None)
        if original is not None:
            saved.append((owner, name, original))
            setattr(owner, name, _wrap(original, record, kind, op, check))

    for name in _METHODS:
        patch(torch.Tensor, name, name, f"Tensor.{name}")
    if dist.is_available():
        from torch.distributed import distributed_c10d as c10d

        for owner in {dist, c10d}:
            for name in _OBJECT_COLLECTIVES:
                patch(owner, name, "object collective", name)
            patch(owner, "all_to_all_single", "split sizes", "all_to_all_single", _list_splits)
        from torch.distributed import _functional_collectives as funcol

        for name in ("all_to_all_single", "all_to_all_single_autograd"):
            patch(funcol, name, "split sizes", f"funcol.{name}", _funcol_list_splits)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextlib.contextmanager
def count_host_reads(phase: bool = True) -> Iterator[HostReads]:
    """Record every device-to-host read made inside the block (this thread's; see the module's docstring)::

    with count_host_reads() as reads:
        train_step(...)
    assert not reads.reads, reads.summary()
    """
    out = HostReads()

    def record(kind: str, op: str) -> None:
        if _STATE.depth == 0:
            out.reads.append(HostRead(kind, op, _where(), _phase() if phase else ""))

    with _patched(record), _Mode(record):
        yield out
