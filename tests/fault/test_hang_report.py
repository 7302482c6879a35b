"""Hang reports (titanlike/hang.py) on CPU: 2-rank training jobs in which rank 1 stops (SIGSTOP) inside an expert
all-to-all, inside a pipeline transfer, or in the data loading, and one in which the two ranks issue different
collectives in the same slot (a planted bug); ``comm.timeout_seconds`` 5. The verdict names the rank, the
collective and the phase, and is written within the timeout plus a few seconds. A report on SIGUSR2 (rank 0, with
rank 1 stopped in the data loading and a 60 s timeout) comes at once. One shared launch (hang_worker.py) runs the
jobs one after the other."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import tiny_run_args, worker_env

from titanlike.data import asset_path

WORKER = Path(__file__).with_name("hang_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
TIMEOUT = 5
SLACK = 10  # seconds past the timeout the verdict may take on the loaded machine (the grace waits are 3 s each)

COMMON = [
    "--model.flavor",
    "tiny",
    "--training.device",
    "cpu",
    "--training.steps",
    "4",
    *tiny_run_args(CORPUS),
    "--comm.timeout_seconds",
    str(TIMEOUT),
]
MODES = {
    "a2a": ["--model.name", "qwen3_moe", "--parallelism.expert_parallel_degree", "2"],
    "p2p": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    "data": [],
    "mismatch": [],
    "signal": ["--comm.timeout_seconds", "60"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hang")
    for mode, extra in MODES.items():
        (out / f"{mode}.args").write_text("\n".join(extra))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), *MODES, "--", *COMMON],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"the shared launch took {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def verdict(dump: Path, kind: str = "timeout") -> tuple[str, float]:
    path = dump / "hang" / f"verdict.{kind}.txt"
    assert path.exists(), (dump / "rank0.log").read_text()[-3000:]
    return path.read_text(), path.stat().st_mtime


def seconds_to_verdict(dump: Path, kind: str = "timeout", start: str = "fault_time") -> float:
    return verdict(dump, kind)[1] - float((dump / start).read_text())


@pytest.mark.parametrize(
    "mode,expected",
    [
        (
            "a2a",
            "rank 1 never arrived at all_to_all #",
            # where rank 0 waits and where rank 1 stopped: inside the MoE experts' forward
        ),
        ("p2p", "rank 0 waits to send to rank 1 (pipeline p2p send #"),
        ("data", "rank 1 never arrived at all_reduce #"),
    ],
)
def test_a_stopped_rank_is_named_with_the_collective_and_its_phase(runs, mode, expected):
    dump = runs / mode
    codes = json.loads((dump / "codes.json").read_text())["codes"]
    assert codes[0] == 1, codes  # rank 0 failed with the one line; rank 1 (stopped) was killed
    text, _ = verdict(dump)
    lines = text.splitlines()
    assert lines[0].startswith("hang report (rank 0: training step 2 failed: "), text
    assert "records from ranks [0] of 2" in lines[0], text
    body = "\n".join(lines[1:])
    assert expected in body, text
    if mode == "a2a":
        assert "of group 0 (ranks [0, 1]), where rank 0 waits (forward layers.1.moe.experts" in body, text
        assert "rank 1 is stopped, hung or dead: its last phase: forward in layers.1.moe.experts at step 2" in body
    if mode == "p2p":
        assert "rank 1 is stopped, hung or dead: its last phase: forward at step 2" in body, text
    if mode == "data":
        assert "rank 1 is stuck in data loading or I/O: its last phase: data at step 2" in body, text
    took = seconds_to_verdict(dump)
    assert took < TIMEOUT + SLACK, took
    err = next(ln for ln in (dump / "rank0.log").read_text().splitlines() if ln.startswith("error: "))
    assert "rank 1 did not answer within 5 s" in err and f"hang report {dump / 'hang'}" in err, err
    assert json.loads((dump / "hang" / "rank0.timeout.json").read_text())["stacks"][0].startswith("thread Main")
    print(f"{mode}: verdict {took:.1f} s after the stop:\n{text}")


def test_two_ranks_issuing_different_collectives_in_the_same_slot_are_named(runs):
    dump = runs / "mismatch"
    codes = json.loads((dump / "codes.json").read_text())["codes"]
    assert codes == [1, 1], codes  # both alive: both time out and report
    text, _ = verdict(dump)
    assert "records from ranks [0, 1] of 2" in text, text
    assert "mismatched collectives in the same slot #" in text, text
    assert "rank 0: all_reduce #" in text and "(sizes [[3]], Float)" in text, text
    assert "rank 1: all_gather #" in text and "(sizes [[5]], Float)" in text, text
    assert seconds_to_verdict(dump) < TIMEOUT + SLACK
    print(text)


def test_sigusr2_reports_at_once_while_the_collective_still_waits(runs):
    dump = runs / "signal"
    codes = json.loads((dump / "codes.json").read_text())["codes"]
    assert codes[0] == 3, codes  # the test's own exit once the verdict was out (the 60 s timeout never came)
    text, _ = verdict(dump, "signal")
    assert text.startswith("hang report (rank 0: SIGUSR2 received; records from ranks [0] of 2"), text
    assert "rank 1 never arrived at all_reduce #" in text, text
    assert "rank 1 is stuck in data loading or I/O: its last phase: data at step 2" in text, text
    took = seconds_to_verdict(dump, "signal", start="signal_time")
    assert took < 8, took  # the store's grace (3 s) for the records of the other ranks, on the loaded machine
    print(f"signal: verdict {took:.1f} s after SIGUSR2:\n{text}")
