"""dist_utils.spawn's report of a failed launch (its last stderr lines, which a test's failure message keeps) and the
one relaunch shared_launch.results allows: only for a rank a signal ended from outside."""

import sys
from pathlib import Path

from dist_utils import run_script

sys.path.insert(0, str(Path(__file__).parent / "parallel"))
from shared_launch import _killed_from_outside  # noqa: E402

WORKER = Path(__file__).with_name("spawn_fault_worker.py")


def test_a_raising_rank_is_named_first_and_no_relaunch():
    proc = run_script(WORKER, "raise", timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.rpartition("=== spawn:")[2]
    assert "the first to fail, rank1:" in last and "ValueError: planted failure on rank 1" in last, proc.stderr[-3000:]
    assert _killed_from_outside(proc.stderr) == ""  # a Python error of the code under test: never launched again


def test_a_rank_killed_by_a_signal_is_named_and_allows_a_relaunch():
    proc = run_script(WORKER, "kill", timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.rpartition("=== spawn:")[2]
    assert "rank 2: -9 (SIGKILL)" in last, proc.stderr[-3000:]
    assert _killed_from_outside(proc.stderr) == "rank 2: -9 (SIGKILL)"
