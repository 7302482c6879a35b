"""The two runs of tests/parallel/test_pipeline_train.py, one interpreter for both.

    python tests/parallel/pipeline_train_worker.py OUT_DIR NPROC -- <common train.py options> -- <parallel options>

``train.py`` (``titanlike.training.trainer.main``) on ``NPROC`` ranks forked from this process with the common and
the parallel options into ``OUT_DIR/pp`` (``dist_utils.run_trainer_job``: exactly as under torchrun), then one plain
process (this one, after the forks) with the common options into ``OUT_DIR/single``. The trainer is imported once.
Exits non-zero when a run fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import run_jobs_then_single  # noqa: E402

import titanlike.training.trainer  # noqa: E402,F401  (imported once, before the forks)


def main() -> int:
    first = sys.argv.index("--")
    second = sys.argv.index("--", first + 1)
    out, nproc = Path(sys.argv[1]), int(sys.argv[2])
    common, parallel = sys.argv[first + 1 : second], sys.argv[second + 1 :]
    return run_jobs_then_single(out, {"pp": [*common, *parallel]}, common, world_size=nproc)


if __name__ == "__main__":
    sys.exit(main())
