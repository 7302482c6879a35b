"""Read what an offline wandb run wrote (``<dir>/wandb/offline-run-*/run-<id>.wandb``): wandb's record log (a
7-byte header ``:W&B`` + magic 0xBEE1 + version 0, then LevelDB-log style 32 KiB blocks of chunks, each a 7-byte
header: CRC32C, length, type full / first / middle / last) of ``wandb_internal_pb2.Record`` protobufs. wandb 0.31
reads it in its Go core only, so the tests parse it here."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: str | Path) -> dict[int, dict]:
    """step -> {metric: value} of every ``log`` (several logs of one step merged)."""
    steps: dict[int, dict] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            steps.setdefault(int(row.pop("_step")), {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return steps


def run_record(path: str | Path):
    """The run record: ``run_id``, ``project``, ``entity``, ``display_name`` and the run's ``config``."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: str | Path) -> dict:
    """The run's config as given to ``wandb.init`` (top-level keys; later config records update it)."""
    out = {i.key: json.loads(i.value_json) for i in run_record(path).config.update}
    for r in records(path):
        if r.WhichOneof("record_type") == "config":
            out.update({i.key: json.loads(i.value_json) for i in r.config.update})
    return out


def run_files(dump_folder: str | Path) -> list[Path]:
    """The offline run logs under ``<dump_folder>/wandb``, oldest first."""
    return sorted(Path(dump_folder).glob("wandb/offline-run-*/run-*.wandb"))
