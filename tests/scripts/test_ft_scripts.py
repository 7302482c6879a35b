"""scripts/ft_groups.sh as a user runs it: a lighthouse and two replica groups of one rank each on this machine
(real torchrun), 3 steps; both groups take part in every step and log the same losses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dist_utils import unused_port, worker_env

pytest.importorskip("torchft", reason="the optional extra titanlike[ft] (torchft) is not installed")

REPO = Path(__file__).resolve().parents[2]


def test_ft_groups_script_trains_two_groups_in_step(tmp_path):
    env = worker_env(
        NUM_GROUPS="2",
        NPROC_PER_GROUP="1",
        DUMP_FOLDER=str(tmp_path),
        LIGHTHOUSE_PORT=str(unused_port()),
        BASE_PORT=str(unused_port()),
        RUST_LOG="warn",
    )
    args = ["--model.flavor", "tiny", "--training.steps", "3", "--training.seq_len", "32"]
    args += ["--training.local_batch_size", "2", "--validation.enable", "false", "--metrics.log_freq", "1"]
    proc = subprocess.run(
        ["bash", "scripts/ft_groups.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    logs = {g: (tmp_path / f"group{g}" / "console.log").read_text() for g in (0, 1)}
    assert proc.returncode == 0, (proc.stdout, proc.stderr, logs)
    rows = {
        g: [json.loads(line) for line in (tmp_path / f"group{g}" / "metrics.jsonl").read_text().splitlines()]
        for g in (0, 1)
    }
    assert [r["step"] for r in rows[0]] == [1, 2, 3] and [r["participants"] for r in rows[0]] == [2, 2, 2]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    assert "replica groups [0, 1] take part (2 of 2)" in logs[0] and (tmp_path / "lighthouse.log").exists()
