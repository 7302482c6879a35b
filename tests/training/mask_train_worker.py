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

from dist_utils import run_trainer_job  # noqa: E402

from titanlike.training.trainer import main as train_main  # noqa: E402

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
    for name, extra in JOBS.items():
        codes = run_trainer_job(out / name, [*argv, *extra])
        if any(codes):
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    import torch

    torch.set_num_threads(1)
    return train_main([*argv, "--job.dump_folder", str(out / "single")])


if __name__ == "__main__":
    sys.exit(main())
