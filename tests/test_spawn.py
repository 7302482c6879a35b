"""dist_utils.spawn's report of a failed launch (its last stderr lines, which a test's failure message keeps), the
one relaunch shared_launch.results allows (only for a rank a signal ended from outside), and run_script's timeout,
which kills the launch's ranks too."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
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


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timed_out_launch_is_killed_with_its_ranks(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(WORKER, "hang", str(pids), timeout=15)
    ranks = [int(x) for x in pids.read_text().split()]
    assert len(ranks) == 3, ranks  # every rank had started before the limit
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), [Path(f"/proc/{p}/stat").read_text() for p in ranks if _alive(p)]
