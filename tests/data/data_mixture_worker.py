"""Training jobs of two forked ranks, one after the other, for tests/data/test_data_mixture_dist.py.

    python tests/data/data_mixture_worker.py OUT_DIR JOB [JOB ...] -- <train.py options>

A JOB is ``NAME`` (a fresh run into OUT_DIR/NAME) or ``NAME:FROM:STEP`` (OUT_DIR/FROM's checkpoint step-STEP is
copied into OUT_DIR/NAME first, so that the run resumes from it). Each job runs on two ranks forked from this
process (``dist_utils.run_trainer_job``: the trainer exactly as under torchrun), which imported the trainer once.
Exits non-zero when a rank of a job fails.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer  # noqa: E402, F401 - imported once, before the forks


def main() -> int:
    split = sys.argv.index("--")
    out, jobs, argv = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    for job in jobs:
        name, _, resume = job.partition(":")
        if resume:
            source, step = resume.split(":")
            src = out / source / "checkpoint" / f"step-{step}"
            shutil.copytree(src, out / name / "checkpoint" / src.name)
        codes = run_trainer_job(out / name, argv)
        if any(codes):
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
