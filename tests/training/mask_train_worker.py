"""The done-when runs of document masking, for tests/training/test_masked_train.py.

    python tests/training/mask_train_worker.py OUT_DIR -- <train.py options>

Three jobs of ``train.py`` (``titanlike.training.trainer.main``) with the same options, one after the other: ``cp2``
and ``pp2_zbv`` on two ranks forked from this process (``dist_utils.run_trainer_job``: exactly as under torchrun),
then ``single``, one plain process (this one, after the forks). The trainer is imported once. Exits non-zero when a
job fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import run_jobs_then_single  # noqa: E402

import titanlike.training.trainer  # noqa: E402,F401  (imported once, before the forks)

JOBS = {
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2_zbv": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "ZBVZeroBubble",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ],
}


def main() -> int:
    split = sys.argv.index("--")
    out, argv = Path(sys.argv[1]), sys.argv[split + 1 :]
    return run_jobs_then_single(out, {name: [*argv, *extra] for name, extra in JOBS.items()}, argv)


if __name__ == "__main__":
    sys.exit(main())
