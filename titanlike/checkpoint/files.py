"""The checkpoint folder on disk: step folders, their commit marker, atomic writes and removals, leftovers.

Layout of ``checkpoint.folder`` (relative to ``job.dump_folder`` unless absolute)::

    step-200/                  committed: DCP files (.metadata, __<rank>_0.distcp) + checkpoint.json (+ checksums.json)
    step-300.tmp-1a2b3c4d/     a save in progress, or one killed mid-write: ignored, removed at the next start
    step-400.incomplete-…/     a step folder without .metadata found at the start, set aside (never resumed)
    final/                     checkpoint.export_safetensors: model.safetensors + config.json

A ``step-N`` folder is committed when it holds DCP's ``.metadata``, which DCP's coordinator writes only after every
rank's data files are written, and which only a rename of the complete temporary folder makes appear.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

from titanlike import restricted_unpickle
from titanlike.config import ConfigError, JobConfig

STEP_DIR = re.compile(r"step-(\d+)")
LEFTOVER_DIR = re.compile(r"(step-\d+|final)\.(tmp|new|trash)-[\w.-]+")  # killed saves, deletions in progress
# What a save of ours writes into such a folder: a leftover holding anything else is not removed.
_OUR_FILES = re.compile(
    r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+_(crc32|checksums)\.json|checkpoint\.json|checksums\.json"
    r"|model\.safetensors|config\.json|\.write-test-\w+"
)
_SINGLE_PROCESS_NOTE = r"torch\.distributed is (disabled, )?unavailable or uninitialized"
# DCP notes on every single-process save/load that it "assumes the intent": it is ours. Filtered for the process
# (an async save warns from its own thread, outside any catch_warnings) and again around each call (pytest resets).
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)


def quiet_dcp(fn, *args, **kwargs):
    """Call a DCP function without its warnings that a single-process run "assumes the intent" (it is ours) and
    that async saves are experimental."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
        warnings.filterwarnings("ignore", message=r".*experimental")
        return fn(*args, **kwargs)


def checkpoint_folder(cfg: JobConfig) -> Path:
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def committed_checkpoints(folder: str | os.PathLike) -> dict[int, Path]:
    """step -> folder of every committed checkpoint in ``folder`` (``step-N`` holding DCP metadata), by step."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if m and (p / ".metadata").is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict, compact: bool = False) -> None:
    """Write ``data`` as JSON and fsync it (indented for people, or ``compact`` for records only tools read)."""
    text = json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2)
    with open(path, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def remove_dir(path: Path, run_id: str) -> None:
    """Rename aside (atomic: the folder stops looking committed at once), then delete."""
    trash = path.with_name(f"{path.name}.trash-{run_id}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def only_ours(folder: Path) -> bool:
    """True when ``folder`` holds only files that a checkpoint save or export writes (safe to delete)."""
    return all(f.is_file() and _OUR_FILES.fullmatch(f.name) for f in folder.iterdir())


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and prove a file can be written in it; ConfigError otherwise."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"checkpoint.folder: '{folder}' is a file, not a folder; choose another checkpoint.folder "
            f"or job.dump_folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"checkpoint.folder: cannot write checkpoints to '{folder}' ({e.strerror or e}); "
            f"choose a writable checkpoint.folder or job.dump_folder"
        ) from None


def read_dcp_metadata(path: str | os.PathLike):
    """The DCP metadata of a checkpoint folder, after checking every data file it names is there in full.

    A truncated or missing file, or an unreadable ``.metadata``, is a ConfigError naming the checkpoint.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        what = "does not exist" if not path.exists() else "is not a checkpoint folder (it has no .metadata)"
        raise ConfigError(f"checkpoint '{path}' {what}")
    try:
        metadata = restricted_unpickle.read_metadata(path)  # executes nothing from the file (restricted_unpickle.py)
    except restricted_unpickle.UnsafeCheckpointError as e:
        raise ConfigError(f"checkpoint '{path}' is refused: its .metadata {e}") from None
    except Exception as e:  # noqa: BLE001 - pickle raises anything on a corrupted file
        raise ConfigError(
            f"checkpoint '{path}' is corrupted: its .metadata cannot be read ({type(e).__name__}: {e})"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have} of {size} bytes)"
            raise ConfigError(f"checkpoint '{path}' is corrupted: {name} {what}")
    return metadata
