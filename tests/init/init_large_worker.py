"""The 8-rank job of tests/init/test_init_large.py: ``train.py`` (``titanlike.training.trainer.main``) on 8 ranks forked
from this process (``dist_utils.run_trainer_job``: exactly as under torchrun, RANK / WORLD_SIZE / MASTER_ADDR in the
environment, the trainer creating the process group), which imported the trainer once instead of 8 times.

    python tests/init/init_large_worker.py DUMP_DIR -- <train.py options>

Rank r's output goes to ``DUMP_DIR/rank<r>.log``; exits with the first non-zero exit code of a rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer  # noqa: E402, F401 - imported once, before the fork, for every rank


def main() -> int:
    split = sys.argv.index("--")
    dump, argv = Path(sys.argv[1]), sys.argv[split + 1 :]
    codes = run_trainer_job(dump, argv, world_size=8)
    print(f"exit codes of the 8 ranks: {codes}")
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
