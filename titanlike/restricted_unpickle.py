"""Loading a checkpoint never runs code: the one place where titanlike decides what a checkpoint file may contain.

A DCP checkpoint holds two kinds of pickles. ``.metadata`` is a plain ``pickle`` of DCP's metadata dataclasses, and
every non-tensor entry of the state dict (the counters, the data position, the LR scheduler, the optimizer's
param-group hyperparameters) is a ``torch.save`` blob inside a ``.distcp`` file. Stock DCP unpickles both without
restriction (``pickle.load`` and ``torch.load(weights_only=False)``), so a crafted checkpoint runs any code it likes
the moment it is opened. Here:

* ``.metadata`` is read by :class:`_MetadataUnpickler`, which resolves only the globals DCP metadata is made of
  (``METADATA_GLOBALS``: the ``torch.distributed.checkpoint.metadata`` dataclasses, ``_StorageInfo``, ``torch.Size``,
  torch dtypes and layouts, ``pathlib`` paths; found by reading the ``.metadata`` of checkpoints written under every
  layout with torch 2.13; DCP's metadata classes are the same in torch 2.11). Any other global is refused by name
  without being imported or called; every refused name of the file is reported at once. Pickle's BUILD can also set
  attributes on an allowed *class* (not only on instances); the classes are compared with a snapshot around each
  read and restored, and such a file is refused too. The object is then checked field by field (types, and data
  file names that stay inside the checkpoint folder) before DCP sees it.
* byte entries are read by :class:`SafeLoadPlanner` with ``torch.load(weights_only=True)`` (plain Python data and
  tensors only); entries that need anything else are refused by name, all of them in one error.

:func:`load` is ``dcp.load`` with both; :func:`read_metadata` is the validated metadata of a folder. Tensor data
is already read by DCP with ``weights_only=True``; ``checkpoint.json`` is JSON.
"""

from __future__ import annotations

import copyreg
import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than data (it would have run code if unpickled without limits)."""


class UnparseableEntryError(ValueError):
    """A byte entry is not a pickle at all (damaged bytes): corruption of its file, not unsafe content."""


# (module, name) -> the object; what DCP's pickler writes for the metadata of every layout (see the module docstring).
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (
            md.Metadata,
            md.MetadataIndex,
            md.StorageMeta,
            md.TensorStorageMetadata,
            md.BytesStorageMetadata,
            md.ChunkStorageMetadata,
            md.TensorProperties,
            md._MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # torch.strided is pickled as a lookup
    # StorageMeta.checkpoint_id is the path the checkpoint was saved to (pathlib._local since Python 3.13)
    **{
        (mod, c.__name__): c
        for mod in ("pathlib", "pathlib._local")
        for c in (pathlib.PosixPath, pathlib.PurePosixPath)
    },
}
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}  # torch.float32, torch.uint8, ...
# Python objects among them whose attributes pickle's BUILD could set: compared with a snapshot around every read.
_GUARDED = [v for v in METADATA_GLOBALS.values() if hasattr(v, "__dict__")]
for _cls in _GUARDED:  # the one attribute pickling adds to a class (a cache): add it now, not during a read
    if isinstance(_cls, type):
        copyreg._slotnames(_cls)


class _Refused:
    """Stands in for a refused global so that unpickling can go on and find every other one; calling it does
    nothing."""

    def __call__(self, *args, **kwargs):
        return self


class _MetadataUnpickler(pickle.Unpickler):  # the C unpickler: only find_class runs in Python
    def __init__(self, file):
        super().__init__(file)
        self.refused: list[str] = []

    def find_class(self, module: str, name: str):
        obj = METADATA_GLOBALS.get((module, name))
        if obj is None and module == "torch":
            obj = _DTYPES.get(name)
        if obj is None:
            if f"{module}.{name}" not in self.refused:
                self.refused.append(f"{module}.{name}")
            return _Refused()
        return obj


def _tampered_classes(snapshot: list[dict]) -> list[str]:
    """Names of guarded classes whose attributes changed since ``snapshot``; puts the originals back."""
    bad = []
    for obj, before in zip(_GUARDED, snapshot):
        now = vars(obj)
        if len(now) == len(before) and all(now.get(k, before) is v for k, v in before.items()):
            continue
        bad.append(getattr(obj, "__qualname__", repr(obj)))
        for k in [k for k in now if k not in before]:
            delattr(obj, k)
        for k, v in before.items():
            if now.get(k, before) is not v:
                setattr(obj, k, v)
    return bad


def unpickle_metadata(data: bytes | io.IOBase) -> md.Metadata:
    """DCP metadata from a pickle, resolving only ``METADATA_GLOBALS`` and validated field by field.

    Raises UnsafeCheckpointError naming every refused global (nothing of them was imported or called), and
    ValueError (or pickle's own errors) for a file that is not DCP metadata.
    """
    unpickler = _MetadataUnpickler(io.BytesIO(data) if isinstance(data, bytes) else data)
    snapshot, error = [dict(vars(v)) for v in _GUARDED], None
    try:
        obj = unpickler.load()
    except Exception as e:  # noqa: BLE001 - a refused global in the way of the rest: report the refusal
        error = e
    tampered = _tampered_classes(snapshot)
    if unpickler.refused:
        raise UnsafeCheckpointError(
            f"would import {', '.join(unpickler.refused)}, which DCP metadata never holds (refused unexecuted)"
        )
    if tampered:
        raise UnsafeCheckpointError(f"would change the class {', '.join(tampered)} (refused)")
    if error is not None:
        raise error
    _check_metadata(obj)
    return obj


def _bad(what: str) -> ValueError:
    return ValueError(f"not DCP metadata: {what}")


def _size(s) -> bool:
    return type(s) is torch.Size and min(s, default=0) >= 0  # torch.Size holds ints only


def _plain(x, depth: int = 0) -> bool:
    if x is None or type(x) in (str, int, float, bool):
        return True
    if type(x) in (tuple, list) and depth < 8:
        return all(_plain(v, depth + 1) for v in x)
    if type(x) is dict and depth < 8:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return False


def _check_metadata(m) -> None:
    """Every field of DCP metadata has the type DCP gives it, and data files are named inside the folder (messages
    are formatted only on failure: this runs for every entry of every load)."""
    if type(m) is not md.Metadata:
        raise _bad(f"the file holds a {type(m).__name__}")
    if type(m.state_dict_metadata) is not dict or type(m.storage_data) is not dict:
        raise _bad("state_dict_metadata or storage_data is not a dict")
    tensor, props, chunk_t, dtype = md.TensorStorageMetadata, md.TensorProperties, md.ChunkStorageMetadata, torch.dtype
    for key, e in m.state_dict_metadata.items():
        if type(key) is not str:
            raise _bad(f"the key {key!r} is not a string")
        if type(e) is md.BytesStorageMetadata:
            continue
        if not (
            type(e) is tensor
            and type(e.properties) is props
            and type(e.properties.dtype) is dtype
            and _size(e.size)
            and type(e.chunks) is list
            and all(type(c) is chunk_t and _size(c.offsets) and _size(c.sizes) for c in e.chunks)
        ):
            raise _bad(f"the entry {key!r} is not a well-formed tensor or bytes entry")
    for index, info in m.storage_data.items():
        if not (type(index) is md.MetadataIndex and type(index.fqn) is str and type(info) is _StorageInfo):
            raise _bad(f"a storage entry is a {type(index).__name__}: {type(info).__name__}")
        name = info.relative_path
        if not (
            type(name) is str
            and name not in ("", ".", "..")
            and "/" not in name
            and os.sep not in name
            and "\0" not in name
        ):
            raise _bad(f"storage of {index.fqn!r} names the file {name!r}, outside the checkpoint")
        if not (
            type(info.offset) is int
            and type(info.length) is int
            and info.offset >= 0
            and info.length >= 0
            and (
                info.transform_descriptors is None
                or (
                    type(info.transform_descriptors) in (list, tuple)
                    and all(type(t) is str for t in info.transform_descriptors)
                )
            )
        ):
            raise _bad(f"storage of {index.fqn!r} has a bad offset, length or transform")
    if not (
        _plain(m.planner_data)
        and (m.storage_meta is None or type(m.storage_meta) is md.StorageMeta)
        and (m.version is None or type(m.version) is str)
    ):
        raise _bad("planner_data, storage_meta or version is not what DCP writes")


def read_metadata(path: str | os.PathLike, rank: int | None = None) -> md.Metadata:
    """The validated DCP metadata of a checkpoint folder (``.metadata``, or rank-local ``__<rank>.metadata``)."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    return unpickle_metadata((Path(path) / name).read_bytes())


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata read by :func:`unpickle_metadata`; refused byte entries (see
    SafeLoadPlanner) fail the read, on every rank (DCP gathers the failures of its read step)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = unpickle_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        future = super().read_data(plan, planner)
        raise_refused(planner)
        return future


def raise_refused(planner) -> None:
    """After a read: UnsafeCheckpointError naming every byte entry ``planner`` (a SafeLoadPlanner) refused."""
    refused = getattr(planner, "refused", None)
    if refused:
        what = "; ".join(f"{k!r} would import {v}" for k, v in sorted(refused.items()))
        raise UnsafeCheckpointError(f"entries that are not plain data: {what} (refused unexecuted)")


_GLOBAL = re.compile(r"GLOBAL (\S+)")
_WEIGHTS_ONLY_DETAIL = re.compile(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", re.S)


def load_error_detail(exc: BaseException) -> str:
    """The telling part of what ``torch.load`` raised: the weights-only unpickler's own reason (``Unsupported
    operand 197``) rather than its advice, else the last line."""
    text = str(exc).strip()
    found = _WEIGHTS_ONLY_DETAIL.search(text)
    if found:
        return " ".join(found.group(1).split())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte entries with ``torch.load(weights_only=True)``: plain Python data
    (the counters, the data position, the scheduler, the optimizer's hyperparameters) and tensors load unchanged,
    anything that parses but needs a global is recorded in ``refused`` (and the read fails) without being imported
    or called; bytes that do not parse at all raise :class:`UnparseableEntryError` (damage, not a threat)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused: dict[str, str] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = _GLOBAL.search(str(e))
            if found is None:
                raise UnparseableEntryError(f"UnpicklingError: {load_error_detail(e)}") from None
            self.refused[fqn] = found.group(1)
            return
        except Exception as e:  # noqa: BLE001 - whatever a damaged archive raises (zip, EOF, legacy format)
            raise UnparseableEntryError(f"{type(e).__name__}: {load_error_detail(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state_dict: dict, checkpoint_id: str | os.PathLike, **kwargs) -> None:
    """``dcp.load`` that executes nothing from the files: restricted metadata, byte entries as data only."""
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(checkpoint_id)), planner=SafeLoadPlanner(), **kwargs)
