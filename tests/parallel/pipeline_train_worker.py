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

from dist_utils import run_trainer_job  # noqa: E402

from titanlike.training.trainer import main as train_main  # noqa: E402


def main() -> int:
    first = sys.argv.index("--")
    second = sys.argv.index("--", first + 1)
    out, nproc = Path(sys.argv[1]), int(sys.argv[2])
    common, parallel = sys.argv[first + 1 : second], sys.argv[second + 1 :]
    codes = run_trainer_job(out / "pp", [*common, *parallel], world_size=nproc)
    if any(codes):
        for r in range(nproc):
            print(f"--- rank {r}:\n{(out / 'pp' / f'rank{r}.log').read_text()[-3000:]}", file=sys.stderr)
        print(f"parallel run: exit codes {codes}", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(1)
    return train_main([*common, "--job.dump_folder", str(out / "single")])


if __name__ == "__main__":
    sys.exit(main())
