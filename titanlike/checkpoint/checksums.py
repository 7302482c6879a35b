"""Checksums of a checkpoint (``checkpoint.checksum``, on by default): computed while the bytes are written, verified
while they are read for a load, before any weight is used.

Every entry DCP writes (a tensor chunk, or a byte entry: the counters, the data position, the scheduler, AdamW's
hyperparameters) gets a CRC32C (hardware-accelerated, the ``crc32c`` package) of its bytes, computed from the bytes in
memory as the save hands them to DCP's writer: for a tensor, its values (the bytes of its elements in order); for a
byte entry, the bytes written. Each rank records its entries in ``__<rank>_checksums.json`` beside its data files;
at the commit rank 0 merges them into ``checksums.json``, with the sizes of the data files and a CRC32C of
``.metadata`` and ``checkpoint.json``. A load reads every entry it needs once, as DCP does, and compares the
CRC32C of the values it read (:class:`VerifyingReader`): each rank verifies exactly what it loads, whatever the
layout, and a mismatch stops the load before the state is used. Nothing is read twice.

Checkpoints written before (a CRC-32 of each whole file, ``"algorithm": "crc32"``) are verified file by file before
the load, as they were; checkpoints without ``checksums.json`` load with a note.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from titanlike import restricted_unpickle
from titanlike.checkpoint.files import write_json
from titanlike.checkpoint.meta import META_NAME

CHECKSUMS_NAME = "checksums.json"
ALGORITHM = "crc32c"
LEGACY_ALGORITHM = "crc32"  # whole files, zlib's CRC-32 (checkpoints written before per-entry checksums)
_RECORD_FORMAT = 2
_CHUNK = 16 << 20


class CorruptCheckpointError(ValueError):
    """An entry of a checkpoint's data file differs from what was written, or cannot be parsed at all."""


# ---------------------------------------------------------------------------------------------------- digests
def crc32c_hex(data) -> str:
    """CRC32C of a bytes-like object, as 8 hex digits."""
    return f"{crc32c.crc32c(data):08x}"


def tensor_digest(t: torch.Tensor) -> str:
    """CRC32C of a tensor's values: the bytes of its elements in row-major order (a CPU copy for another device,
    a contiguous copy for a strided view; otherwise the tensor's own memory, nothing copied)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return crc32c_hex(b"")
    return crc32c_hex(t.reshape(-1).view(torch.uint8).numpy())


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """The checksum of a whole file (read in 16 MiB chunks): CRC32C, or the legacy zlib CRC-32."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = crc32c.crc32c(view[:n], crc) if algorithm == ALGORITHM else zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def record_key(relative_path: str, offset: int) -> str:
    """The key of one entry's record: its data file and where it starts in it."""
    return f"{relative_path}@{offset}"


class _Hasher:
    """Tensor digests computed on a thread of their own while DCP goes on writing or reading the next entries
    (``crc32c`` releases the GIL): on a machine with a spare core the hashing hides behind the I/O. ``results()``
    waits for all of them."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titanlike-crc32c")
        self._futures: dict = {}
        self.done: dict = {}

    def submit(self, key, tensor: torch.Tensor) -> None:
        self._futures[key] = self._pool.submit(tensor_digest, tensor)

    def results(self) -> dict:
        try:
            self.done.update({k: f.result() for k, f in self._futures.items()})
        finally:
            self._pool.shutdown(wait=True)
        return self.done


# ---------------------------------------------------------------------------------------------------- writing
class _HashingPlanner:
    """DCP's save planner, with the CRC32C of every piece of data it hands to the writer recorded on the way (byte
    entries at once, tensors on the hashing thread; a tensor is not changed while its save runs: training waits for a
    synchronous save, and an async save writes a staged copy)."""

    def __init__(self, planner, hasher: _Hasher):
        self._planner, self._hasher = planner, hasher

    def resolve_data(self, write_item):
        data = self._planner.resolve_data(write_item)
        if isinstance(data, io.BytesIO):
            with data.getbuffer() as view:
                self._hasher.done[write_item.index] = crc32c_hex(view)
            return data
        if data.device.type != "cpu":  # hash the copy DCP writes (it would copy to the CPU next)
            data = data.detach().cpu()
        self._hasher.submit(write_item.index, data)
        return data

    def __getattr__(self, name):
        return getattr(self._planner, name)


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that records the CRC32C of every entry as it is written (from the bytes in memory) in
    ``__<rank>_checksums.json`` beside this rank's data files, before DCP's coordinator writes ``.metadata``; for an
    async save in the background thread. At the commit rank 0 merges the records (:func:`merge_checksums`)."""

    def write_data(self, plan, planner):
        hasher = _Hasher()
        future = super().write_data(plan, _HashingPlanner(planner, hasher))
        digests = hasher.results()
        results = future.wait()
        records = {
            record_key(r.storage_data.relative_path, r.storage_data.offset): {
                "fqn": r.index.fqn,
                "length": r.storage_data.length,
                ALGORITHM: digests[r.index],
            }
            for r in results
        }
        files = {
            name: {"size": (Path(self.path) / name).stat().st_size}
            for name in sorted({r.storage_data.relative_path for r in results})
        }
        part = {"files": files, "records": records}
        write_json(Path(self.path) / f"{plan.storage_data.prefix}checksums.json", part, compact=True)
        return future


def merge_checksums(folder: Path) -> None:
    """Rank 0, at the commit: every rank's records, plus a CRC32C of .metadata and checkpoint.json ->
    checksums.json."""
    files, records = {}, {}
    parts = sorted(folder.glob("__*_checksums.json"))
    for part in parts:
        rank_part = json.loads(part.read_text())
        files.update(rank_part["files"])
        records.update(rank_part["records"])
    for name in (".metadata", META_NAME):
        files[name] = {"size": (folder / name).stat().st_size, ALGORITHM: file_digest(folder / name)}
    write_json(
        folder / CHECKSUMS_NAME,
        {
            "format": _RECORD_FORMAT,
            "algorithm": ALGORITHM,
            "files": dict(sorted(files.items())),
            "records": dict(sorted(records.items())),
        },
        compact=True,
    )
    for part in parts:
        part.unlink()


# ---------------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class Checksums:
    """What ``checksums.json`` records: ``files`` (name -> size, and a whole-file digest where there is one) and,
    for per-entry checksums, ``records`` (``file@offset`` -> fqn, length, CRC32C)."""

    algorithm: str
    files: dict
    records: dict


def read_checksums(path: str | os.PathLike) -> Checksums | str | None:
    """The checksums recorded in a checkpoint's ``checksums.json``; None when there is none, a text saying why when
    it cannot be read."""
    record = Path(path) / CHECKSUMS_NAME
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
        algorithm, files, records = data["algorithm"], data["files"], data.get("records", {})
        if algorithm not in (ALGORITHM, LEGACY_ALGORITHM):
            raise ValueError(f"unknown algorithm {algorithm!r}")
        if not all(isinstance(v, dict) and "size" in v for v in files.values()):
            raise TypeError("a file lacks its size")
        if algorithm == LEGACY_ALGORITHM and not all(LEGACY_ALGORITHM in v for v in files.values()):
            raise TypeError("a file lacks its crc32")
        if not all(isinstance(v, dict) and {"fqn", "length", ALGORITHM} <= v.keys() for v in records.values()):
            raise TypeError("an entry lacks its fqn, length or crc32c")
        return Checksums(algorithm, files, records)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        return f"its {CHECKSUMS_NAME} cannot be read ({type(e).__name__}: {e})"


def check_files(path: str | os.PathLike, sums: Checksums, rank: int = 0, world_size: int = 1) -> str | None:
    """The first file of this rank's share (every ``world_size``-th from ``rank``) that is missing, has another size,
    or (where a whole-file digest is recorded) other bytes than were written; None when all are as written."""
    path = Path(path)
    for name, want in sorted(sums.files.items())[rank::world_size]:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, {want['size']} were written"
        if sums.algorithm in want:
            have = file_digest(f, sums.algorithm)
            if have != want[sums.algorithm]:
                return (
                    f"{name} does not match its checksum ({sums.algorithm} {have}, {want[sums.algorithm]} was written)"
                )
    return None


def _mismatch(relative_path: str, fqn: str, offset: int, length: int, have: str, want: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{relative_path} does not match its checksum at the entry '{fqn}' (bytes {offset}-{offset + length}: "
        f"{ALGORITHM} {have}, {want} was written)"
    )


def _unparseable(relative_path: str, fqn: str, offset: int, length: int, why: str, verdict: str):
    return CorruptCheckpointError(
        f"{relative_path} cannot be parsed at the entry '{fqn}' (bytes {offset}-{offset + length}: {why}); {verdict}"
    )


class VerifyingReader(restricted_unpickle.SafeFileSystemReader):
    """DCP's file reader (metadata and byte entries read without running code, ``restricted_unpickle``) that checks
    every entry it reads against its recorded CRC32C before the values go anywhere, and reports an entry that
    cannot be parsed as corruption of its file (with the checksum's verdict when there is one), not as unsafe
    content. ``records``: the checkpoint's per-entry checksums (None: none recorded, nothing to compare)."""

    def __init__(self, path: str | os.PathLike, records: dict | None):
        super().__init__(path)
        self.records = records

    def _expected(self, relative_path: str, offset: int) -> str | None:
        if self.records is None:
            return None
        rec = self.records.get(record_key(relative_path, offset))
        return None if rec is None else rec[ALGORITHM]

    def read_data(self, plan, planner):
        # DCP's FileSystemReader.read_data (torch 2.13), with the checks added where each entry is in memory: byte
        # entries before they are parsed, tensors on the hashing thread while the next entries are read, all of them
        # before this returns (before DCP hands the state back)
        hasher, expected = _Hasher(), {}
        try:
            self._read_entries(plan, planner, hasher, expected)
        finally:
            digests = hasher.results()
        for where, want in sorted(expected.items()):
            if digests[where] != want:
                raise _mismatch(*where, digests[where], want)
        restricted_unpickle.raise_refused(planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_entries(self, plan, planner, hasher: _Hasher, expected: dict) -> None:
        per_file: dict[str, list] = {}
        for read_item in plan.items:
            per_file.setdefault(self.storage_data[read_item.storage_index].relative_path, []).append(read_item)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    where = (relative_path, req.storage_index.fqn, info.offset, info.length)
                    want = self._expected(relative_path, info.offset)
                    stream_in = self.transforms.transform_load_stream(
                        req, info.transform_descriptors or (), self._slice_file(stream, info)
                    )
                    if req.type == LoadItemType.BYTE_IO:
                        raw = stream_in.read(-1)
                        if want is not None and crc32c_hex(raw) != want:
                            raise _mismatch(*where, crc32c_hex(raw), want)
                        try:
                            planner.load_bytes(req, io.BytesIO(raw))
                        except restricted_unpickle.UnparseableEntryError as e:
                            verdict = (
                                "its bytes match their checksum: it was written like this"
                                if want is not None
                                else "no checksum was compared to tell when it changed"
                            )
                            raise _unparseable(*where, str(e), verdict) from None
                        continue
                    seekable = stream_in if stream_in.seekable() else io.BytesIO(stream_in.read(-1))
                    try:
                        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
                    except Exception as e:  # noqa: BLE001 - whatever a damaged archive raises
                        why = f"{type(e).__name__}: {restricted_unpickle.load_error_detail(e)}"
                        raise _unparseable(*where, why, "the file is damaged") from None
                    if want is not None and where not in expected:
                        expected[where] = want
                        hasher.submit(where, tensor)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(
                            f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)


def load_verified(state_dict: dict, path: str | os.PathLike, records: dict | None, **dcp_kwargs) -> None:
    """``dcp.load`` of ``path`` into ``state_dict`` (resharding as usual) that executes nothing from the files and
    compares every entry read with ``records`` (:class:`VerifyingReader`)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(
        state_dict,
        storage_reader=VerifyingReader(str(path), records),
        planner=restricted_unpickle.SafeLoadPlanner(),
        **dcp_kwargs,
    )


def check_records(path: str | os.PathLike, sums: Checksums, rank: int = 0, world_size: int = 1) -> str | None:
    """Read and verify this rank's share of a checkpoint's entries in this process (a whole-checkpoint scan, for
    tools: a load verifies what it reads by itself); the first problem as text, None when all are as written."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    metadata = restricted_unpickle.read_metadata(path)
    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for key, rec in sorted(sums.records.items())[rank::world_size]:
        name, offset = key.rsplit("@", 1)
        offset, length = int(offset), rec["length"]
        try:
            with open(path / name, "rb") as f:
                f.seek(offset)
                raw = f.read(length)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
        if rec["fqn"] in tensors:
            try:
                have = tensor_digest(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
            except Exception as e:  # noqa: BLE001 - whatever a damaged archive raises
                why = f"{type(e).__name__}: {restricted_unpickle.load_error_detail(e)}"
                return str(_unparseable(name, rec["fqn"], offset, length, why, "the file is damaged"))
        else:
            have = crc32c_hex(raw)
        if have != rec[ALGORITHM]:
            return str(_mismatch(name, rec["fqn"], offset, length, have, rec[ALGORITHM]))
    return None


def verify_checksums(path: str | os.PathLike, rank: int = 0, world_size: int = 1) -> str | None:
    """Compare a checkpoint with its ``checksums.json`` (this rank's share: every ``world_size``-th file and entry
    from ``rank``): files, sizes and every entry; the first mismatch as text (None: all equal, or no checksums were
    recorded)."""
    sums = read_checksums(path)
    if sums is None or isinstance(sums, str):
        return sums
    return check_files(path, sums, rank, world_size) or check_records(path, sums, rank, world_size)
