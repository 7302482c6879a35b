"""scripts/benchmark.py on CPU with a tiny model: both rows print with positive numbers (timings not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import worker_env

from titanlike.kernels import te_available

REPO = Path(__file__).resolve().parents[2]


def test_benchmark_prints_both_rows(tmp_path):
    out = tmp_path / "bench.json"
    env = worker_env()
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "benchmark.py"),
            "--flavor",
            "tiny",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--ac",
            "op",
            "--loss-chunk",
            "16",
            "--peak-tflops",
            "1",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("titanlike", "plain"):
        row = next(line for line in lines if line.startswith(name))
        tokens_per_s = float(row.split()[1].replace(",", ""))
        assert tokens_per_s > 0, row
    assert any(line.startswith("ratio titanlike/plain:") for line in lines)
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == ["titanlike", "plain"]
    for r in result["rows"]:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and r["mfu"] > 0 and r["loss"] > 0
    assert result["ratio"] > 0


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here: the missing-TE error cannot occur")
def test_benchmark_te_without_transformer_engine_is_one_line():
    script = REPO / "scripts" / "benchmark.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--kernels", "te", "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "model.kernels=te needs NVIDIA Transformer Engine" in proc.stderr
