"""``metrics.enable_wandb``: a training run in offline mode (``WANDB_MODE=offline``, no network) logs to its wandb
run every value metrics.jsonl has at the same step, and the config; a resume continues the same run (the id kept
in checkpoint.json); enabling it without the package is one line naming the extra. The offline run files are read
back by ``wandb_offline`` (the record log wandb writes)."""

from __future__ import annotations

import json
import sys

import wandb_offline

from titanlike.checkpoint import read_meta
from titanlike.training.trainer import main

ARGV = [
    "--model.flavor", "tiny", "--model.tokenizer", "test", "--training.seq_len", "32",
    "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--validation.freq", "2",
    "--validation.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "2", "--metrics.enable_wandb",
    "--metrics.wandb_project", "titanlike-test", "--metrics.wandb_run_name", "wandb-test",
]  # fmt: skip


def jsonl(folder) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    return rows


def test_offline_run_logs_what_metrics_jsonl_has_and_a_resume_continues_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "run"
    assert main([*ARGV, "--training.steps", "4", "--job.dump_folder", str(dump)]) == 0
    (first,) = wandb_offline.run_files(dump)
    logged, written = wandb_offline.history(first), jsonl(dump)
    assert sorted(written) == [1, 2, 3, 4] and sorted(logged) == sorted(written)
    for step, row in written.items():  # every value, at its step (None values, e.g. mfu on CPU, are not logged)
        expected = {k: (float(v) if isinstance(v, bool) else v) for k, v in row.items() if v is not None}
        assert {k: logged[step].get(k) for k in expected} == expected, step
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_gib", "val_loss"} <= set(logged[2])
    run = wandb_offline.run_record(first)
    assert run.project == "titanlike-test" and run.display_name == "wandb-test"
    config = wandb_offline.config(first)
    assert config["training"]["steps"] == 4 and config["model"]["flavor"] == "tiny"
    saved = read_meta(dump / "checkpoint" / "step-4")
    assert saved["wandb_run_id"] == run.run_id
    # the resume: same run id, its steps after the checkpoint's
    assert main([*ARGV, "--training.steps", "6", "--job.dump_folder", str(dump)]) == 0
    second = next(f for f in wandb_offline.run_files(dump) if f != first)
    assert wandb_offline.run_record(second).run_id == run.run_id
    assert sorted(wandb_offline.history(second)) == [5, 6]
    assert wandb_offline.history(second)[6]["loss"] == jsonl(dump)[6]["loss"]
    assert read_meta(dump / "checkpoint" / "step-6")["wandb_run_id"] == run.run_id
    assert f"wandb run {run.run_id} (resumed, offline mode)" in capsys.readouterr().out


def test_enabling_wandb_without_the_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails as when it is not installed
    dump = tmp_path / "run"
    assert main([*ARGV, "--training.steps", "2", "--job.dump_folder", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: metrics.enable_wandb: the wandb package is not installed; pip install 'titanlike[wandb]'"
    assert not dump.exists()  # nothing written


def test_off_it_needs_no_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    dump = tmp_path / "run"
    off = ["--metrics.enable_wandb=false", "--checkpoint.enable=false", "--training.steps", "1"]
    assert main([*ARGV, *off, "--job.dump_folder", str(dump)]) == 0
    assert (dump / "metrics.jsonl").is_file() and not (dump / "wandb").exists()
