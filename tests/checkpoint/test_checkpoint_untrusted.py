"""A checkpoint from elsewhere never runs code: crafted ``.metadata`` and byte entries are refused, unexecuted.

Each attack is a pickle whose ``__reduce__`` calls ``os.system("touch <marker>")``, with checksums.json forged to
match (checksums find damage, they authenticate nothing); the tests assert the refusal
names the global, ``python train.py ... --checkpoint.enable`` prints one line and exits 2, and the marker file is
never created. Ordinary checkpoints still load (every other checkpoint test goes through the same reader).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import worker_env

from titanlike import restricted_unpickle
from titanlike.checkpoint import read_dcp_metadata, read_model_state_dict
from titanlike.config import ConfigError, load_config
from titanlike.data import asset_path
from titanlike.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))


def args(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "3",
        "--training.global_batch_size",  # the same run on one process and on 2 ranks (local batch derived)
        "2",
        "--training.seq_len",
        "16",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.enable_jsonl",
        "false",
        "--metrics.log_freq",
        "100",
        "--job.dump_folder",
        str(dump),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        *extra,
    ]


class Touch:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A dump folder whose checkpoint folder holds step-2 of the tiny model."""
    dump = tmp_path_factory.mktemp("saved")
    Trainer(load_config(args(dump, "--training.steps", "2"), world_size=1)).train()
    return dump


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    dump = tmp_path / "dump"
    shutil.copytree(saved, dump)
    return dump, dump / "checkpoint" / "step-2", tmp_path / "PWNED"


def _metadata(step: Path):
    with open(step / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file, written just now: trusted


def _forge_checksums(step: Path, entry: tuple[str, int, bytes] | None = None) -> None:
    """Rewrite checksums.json to match the crafted files, as an attacker can (checksums find damage, they do not
    authenticate): the sizes, the CRC32C of .metadata, and that of a crafted entry ``(file, offset, bytes)``."""
    from titanlike.checkpoint.checksums import crc32c_hex, file_digest, record_key

    record = json.loads((step / "checksums.json").read_text())
    for name, info in record["files"].items():
        info["size"] = (step / name).stat().st_size
        if "crc32c" in info:
            info["crc32c"] = file_digest(step / name)
    if entry is not None:
        name, offset, blob = entry
        record["records"][record_key(name, offset)] = {"fqn": "forged", "length": len(blob), "crc32c": crc32c_hex(blob)}
    (step / "checksums.json").write_text(json.dumps(record))


def craft_metadata(step: Path, marker: Path) -> None:
    """The real metadata with a payload deep inside it (and a second, different one)."""
    md = _metadata(step)
    md.planner_data = {"train.step": ("train", "step"), "x": Touch(marker)}
    md.version = type("Eval", (), {"__reduce__": lambda self: (eval, (f"open('{marker}', 'w')",))})()
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _forge_checksums(step)


def craft_byte_entry(step: Path, marker: Path, fqn: str = "train.step") -> None:
    """Replace the byte entry ``fqn`` by a torch.save blob of a payload (appended; the metadata points at it)."""
    md = _metadata(step)
    index = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data[index]
    data = step / info.relative_path
    blob = io.BytesIO()
    torch.save(Touch(marker), blob)
    info.offset, info.length = data.stat().st_size, len(blob.getvalue())
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _forge_checksums(step, (info.relative_path, info.offset, blob.getvalue()))


def test_crafted_metadata_and_byte_entry_refused_through_train_py(saved, tmp_path):
    """The ordinary resume command on each crafted checkpoint prints one line and exits 2, nothing executed:
    ``python train.py`` on the crafted metadata and, side by side, ``torchrun`` with 2 ranks (FSDP, resharding the
    one-process checkpoint) on the crafted byte entry, where every rank reads the entry and refuses it (no hang)."""
    env = worker_env()
    logs = tmp_path / "logs"
    launch = {
        "metadata": [sys.executable, "train.py"],
        "bytes": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--log-dir",
            str(logs),
            "--redirects",
            "3",
            "train.py",
        ],
    }
    cases = {}
    for name, craft in [("metadata", craft_metadata), ("bytes", craft_byte_entry)]:
        dump, step, marker = _copy(saved, tmp_path / name)
        craft(step, marker)
        proc = subprocess.Popen(
            [*launch[name], *args(dump)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        cases[name] = (proc, step, marker)
    for name, (proc, step, marker) in cases.items():
        _, err = proc.communicate(timeout=240)
        if name == "metadata":
            assert proc.returncode == 2, err[-3000:]
            err = err.strip()
            assert err.startswith("error: ") and "\n" not in err, err
            assert f"checkpoint '{step}' is refused: its .metadata would import posix.system, builtins.eval" in err
        else:
            assert proc.returncode != 0 and "exitcode  : 2" in err, err[-3000:]  # torchrun: a rank exited with 2
            rank_errors = sorted(logs.rglob("stderr.log"))
            assert len(rank_errors) == 2
            # every rank refuses it; the one line comes from global rank 0 only (the job prints it once)
            lines = [ln for log in rank_errors for ln in log.read_text().splitlines() if ln.startswith("error: ")]
            assert len(lines) == 1, [log.read_text() for log in rank_errors]
            assert f"checkpoint '{step}' could not be loaded" in lines[0], lines[0]
            assert "not plain data: 'train.step' would import posix.system (refused unexecuted)" in lines[0]
        assert not marker.exists(), name
        assert not (step.parent / "step-3").exists()  # no training happened


def test_crafted_metadata_refused_by_the_python_api(saved, tmp_path):
    dump, step, marker = _copy(saved, tmp_path)
    craft_metadata(step, marker)
    for fn in (read_dcp_metadata, read_model_state_dict):
        with pytest.raises(ConfigError, match=r"is refused: its \.metadata would import posix\.system, builtins\.eval"):
            fn(step)
    with pytest.raises(restricted_unpickle.UnsafeCheckpointError):
        restricted_unpickle.SafeFileSystemReader(str(step)).read_metadata()
    with pytest.raises(ConfigError, match="is refused"):
        Trainer(load_config(args(dump), world_size=1))
    assert not marker.exists()


def test_crafted_byte_entries_refused_by_the_python_api(saved, tmp_path):
    """Every crafted entry is named in one error; the checkpoint's other entries are plain data."""
    dump, step, marker = _copy(saved, tmp_path)
    craft_byte_entry(step, marker, "train.step")
    craft_byte_entry(step, marker, "train.data_position")
    trainer = Trainer(load_config(args(dump), world_size=1))
    with pytest.raises(
        ConfigError,
        match=r"'train.data_position' would import posix.system; 'train.step' would "
        r"import posix.system \(refused unexecuted\)",
    ):
        trainer.checkpointer.load()
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_byte_entries_and_rng_round_trip_unchanged(saved):
    """Every non-tensor entry (counters, data position, scheduler, AdamW hyperparameters) and the RNG state load
    through the restricted path exactly as through stock DCP."""
    step = saved / "checkpoint" / "step-2"
    md = restricted_unpickle.read_metadata(step)
    assert md == _metadata(step)
    keys = [k for k, v in md.state_dict_metadata.items() if not hasattr(v, "size") or k.startswith("rng.")]
    assert any(k.startswith("optimizer.param_groups.") for k in keys) and "train.data_position" in keys
    ours = {k: None for k in keys if not k.startswith("rng.")}
    stock = dict(ours)
    for k in keys:
        if k.startswith("rng."):
            ours[k], stock[k] = torch.empty_like(torch.get_rng_state()), torch.empty_like(torch.get_rng_state())
    restricted_unpickle.load(ours, step, no_dist=True)
    dcp.load(stock, checkpoint_id=str(step), no_dist=True)
    assert ours.keys() == stock.keys()
    for k in keys:
        assert torch.equal(ours[k], stock[k]) if k.startswith("rng.") else ours[k] == stock[k], k
    assert ours["train.step"] == 2 and ours["train.data_position"] == 2 * 2


def test_metadata_that_changes_a_class_or_names_files_outside_is_refused(saved, tmp_path):
    # BUILD with slot state on a class object is setattr on the class: refused, and the class is put back.
    md_cls = "torch.distributed.checkpoint.metadata\nMetadata\n"
    evil = b"\x80\x04c" + md_cls.encode() + b"N}X\x06\x00\x00\x00__eq__K\x01s\x86b."
    before = restricted_unpickle.md.Metadata.__eq__
    with pytest.raises(restricted_unpickle.UnsafeCheckpointError, match="would change the class Metadata"):
        restricted_unpickle.unpickle_metadata(evil)
    assert restricted_unpickle.md.Metadata.__eq__ is before
    # A data file outside the checkpoint folder: not DCP's metadata, refused before any file is opened.
    step = _copy(saved, tmp_path)[1]
    md = _metadata(step)
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    (step / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        ConfigError,
        match=r"is corrupted: its \.metadata cannot be read \(ValueError: not DCP "
        r"metadata: storage of .* names the file '\.\./\.\./etc/passwd'",
    ):
        read_dcp_metadata(step)
