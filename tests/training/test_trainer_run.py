"""A short run of the debug config through train.py learns, and writes metrics.jsonl and tensorboard events."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titanlike.config import load_config
from titanlike.training.optim import lr_factor

ROOT = Path(__file__).resolve().parents[2]


def test_debug_config_learns(tmp_path):
    out = tmp_path / "run"
    argv = [
        "--job.config_file",
        "configs/debug_model.toml",
        "--training.steps",
        "60",
        "--metrics.log_freq",
        "10",
        "--lr_scheduler.warmup_steps",
        "10",
        "--validation.freq",
        "60",
        "--job.dump_folder",
        str(out),
    ]
    r = subprocess.run(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "loss" in row]
    assert [row["step"] for row in train] == [1, 10, 20, 30, 40, 50, 60]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])
    # the logged lr of step s is the rate its update used: warmup gives step 1 lr / 10, step 10 the full lr
    cfg = load_config(argv)
    assert [row["lr"] for row in train] == pytest.approx(
        [cfg.optimizer.lr * lr_factor(row["step"], cfg) for row in train], rel=1e-12
    )
    assert train[0]["lr"] == pytest.approx(cfg.optimizer.lr / 10) and train[1]["lr"] == pytest.approx(cfg.optimizer.lr)
    first, last = train[0]["loss"], train[-1]["loss"]
    assert first > 7.0  # ~ln(2048) at initialisation
    assert last < first - 1.5, (first, last)  # learns well below its start
    val = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(val) == 1 and val[0] < first - 1.0
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert "step    60" in r.stdout


def test_a_model_too_large_for_the_host_is_refused_up_front_with_the_fix(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--model.flavor",
            "405B",
            "--model.tokenizer",
            "cl100k",
            "--training.seq_len",
            "128",
            "--job.dump_folder",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    line = r.stderr.strip()
    # The state of the one rank (the whole 405B model is its shard: parameters, gradients, AdamW) cannot fit.
    assert "\n" not in line and line.startswith("error: host memory: the one rank on this host needs "), line
    assert " TiB of state" in line and "planner: parameters 1.47 TiB + gradients 1.47 TiB" in line, line
    assert not out.exists()
