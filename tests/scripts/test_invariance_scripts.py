"""The layout-invariance scripts run and print their tables (the numbers are measurements, never asserted)."""

import subprocess
import sys
from pathlib import Path

from dist_utils import worker_env

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_invariance_bench_prints_both_settings_side_by_side():
    out = _run("scripts/invariance_bench.py", "--world", "1", "--seq-len", "16", "--steps", "1", "--virtual", "2")
    assert "| default |" in out and "| invariant |" in out and "invariant / default step time:" in out, out


def test_matmul_bits_prints_a_row_per_dtype_and_shape():
    out = _run("scripts/matmul_bits.py", "--threads", "1")
    rows = [line for line in out.splitlines() if line.startswith("| float32 |") or line.startswith("| bfloat16 |")]
    assert len(rows) == 12 and "full products equal across thread counts" in out, out
