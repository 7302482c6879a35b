"""scripts/init_memory.py: the sharded init's peak host memory per rank against the full-model init, side by side."""

import re
import subprocess
import sys

from dist_utils import REPO, worker_env


def test_sharded_init_peak_is_about_one_shard_and_bad_arguments_are_one_line():
    proc = subprocess.run(
        [sys.executable, "scripts/init_memory.py", "--ranks", "2", "--dim", "512", "--n-layers", "4"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(r"^\s+2\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+M$", proc.stdout, re.M)
    assert row, proc.stdout
    sharded, full, ratio, shards = map(float, row.groups())
    assert ratio < 0.75 and sharded < full, proc.stdout  # ~0.5 at 2 ranks: half the model, not all of it
    bad = subprocess.run(
        [sys.executable, "scripts/init_memory.py", "--layout", "tp", "--n-heads", "6", "--ranks", "4"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
