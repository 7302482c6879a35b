"""The wall time of a short one-process training run, this tree against an earlier commit, side by side in one run.

    python scripts/host_reads_bench.py                        # 20 steps of the debug model, this tree vs 89619ef
    python scripts/host_reads_bench.py --before main --runs 5 --steps 20
    python scripts/host_reads_bench.py --optimizer.implementation fused     # any further option goes to train.py

The earlier commit is extracted with ``git archive`` into a temporary folder. The runs alternate (before, after,
before, ...) so that a shared machine's load falls on both alike; each run is ``python train.py`` of the debug config
with ``--training.steps N`` (validation off, logging every ``--log-freq`` steps), timed by the trainer's own summary
line (the steps' time, start-up excluded). Printed: every run's seconds per step, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(tree: Path, steps: int, log_freq: int, dump: Path, extra: list[str]) -> float:
    argv = [sys.executable, "train.py", *extra, "--training.steps", str(steps), "--validation.enable", "false"]
    argv += ["--metrics.log_freq", str(log_freq), "--job.dump_folder", str(dump)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    match = re.search(r"done: steps .* ([0-9.]+)s per step", out.stdout)
    if out.returncode or not match:
        raise SystemExit(f"the run in {tree} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="89619ef", help="the commit to compare with (git rev)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3, help="runs of each tree")
    ap.add_argument("--log-freq", type=int, default=10)
    args, extra = ap.parse_known_args()  # the rest: train.py options for both trees
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        before.mkdir()
        archive = subprocess.run(["git", "archive", args.before], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        times: dict[str, list[float]] = {"before": [], "after": []}
        for i in range(args.runs):
            for name, tree in (("before", before), ("after", REPO)):
                times[name].append(one_run(tree, args.steps, args.log_freq, Path(tmp) / f"{name}{i}", extra))
                print(f"run {i + 1} {name:6s} {times[name][-1]:.3f}s per step", flush=True)
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"median s/step: before ({args.before}) {b:.3f}  after {a:.3f}  after/before {a / b:.3f}")


if __name__ == "__main__":
    main()
