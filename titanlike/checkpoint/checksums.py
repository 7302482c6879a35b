"""Checksums of a checkpoint's files (``checkpoint.checksum``): written at the commit, verified before a resume.

Every rank records the CRC-32 of the data files it wrote (``__<rank>_crc32.json``, beside them); at the commit rank
0 adds ``.metadata`` and ``checkpoint.json`` and merges the records into ``checksums.json``. Before a resume the
ranks share the verification (each takes every N-th file).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from titanlike.checkpoint.files import write_json
from titanlike.checkpoint.meta import META_NAME

CHECKSUMS_NAME = "checksums.json"
_CHUNK = 16 << 20


def file_crc32(path: Path) -> str:
    """CRC-32 of a file's bytes (zlib's, read in 16 MiB chunks), as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that, once this rank's data files are written (and fsynced), records their CRC-32 in a
    small ``__<rank>_crc32.json`` beside them. The ranks hash in parallel (and, for an async save, in the
    background thread), before DCP's coordinator writes ``.metadata``; at the commit rank 0 merges the records into
    ``checksums.json``."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        files = sorted({r.storage_data.relative_path for r in results})
        sums = {
            name: {"crc32": file_crc32(Path(self.path) / name), "size": (Path(self.path) / name).stat().st_size}
            for name in files
        }
        write_json(Path(self.path) / f"{plan.storage_data.prefix}crc32.json", sums)
        return future


def merge_checksums(folder: Path) -> None:
    """Rank 0, at the commit: every rank's records plus .metadata and checkpoint.json -> checksums.json."""
    sums = {}
    for part in sorted(folder.glob("__*_crc32.json")):
        sums.update(json.loads(part.read_text()))
    for name in (".metadata", META_NAME):
        sums[name] = {"crc32": file_crc32(folder / name), "size": (folder / name).stat().st_size}
    write_json(folder / CHECKSUMS_NAME, {"algorithm": "crc32", "files": dict(sorted(sums.items()))})
    for part in folder.glob("__*_crc32.json"):
        part.unlink()


def read_checksums(path: str | os.PathLike) -> dict | str | None:
    """The ``{file: {"crc32", "size"}}`` recorded in a checkpoint's ``checksums.json``; None when there is none, a
    text saying why when it cannot be read."""
    record = Path(path) / CHECKSUMS_NAME
    if not record.is_file():
        return None
    try:
        files = json.loads(record.read_text())["files"]
        if not all(isinstance(v, dict) and {"crc32", "size"} <= v.keys() for v in files.values()):
            raise TypeError("an entry lacks crc32 or size")
        return files
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        return f"its {CHECKSUMS_NAME} cannot be read ({type(e).__name__}: {e})"


def verify_checksums(path: str | os.PathLike, rank: int = 0, world_size: int = 1) -> str | None:
    """Compare the files of a checkpoint with its ``checksums.json`` (this rank's share: every ``world_size``-th
    file from ``rank``); the first mismatch as text (None: all equal, or no checksums were recorded)."""
    path = Path(path)
    files = read_checksums(path)
    if files is None or isinstance(files, str):
        return files
    for name, want in sorted(files.items())[rank::world_size]:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, {want['size']} were written"
        have = file_crc32(f)
        if have != want["crc32"]:
            return f"{name} does not match its checksum (crc32 {have}, {want['crc32']} was written)"
    return None
