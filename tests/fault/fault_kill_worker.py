"""Run the Trainer (with the test model that draws random numbers, see test_faults.py) in one process and freeze at
one phase of the save of step 4, for tests/test_faults.py to kill -9.

    python tests/fault_kill_worker.py {before_rename|after_rename|mid_purge} READY_FILE <train.py options>

``before_rename``: the folder is complete (DCP's .metadata, checkpoint.json, checksums.json) but not yet renamed to
``step-4``; ``after_rename``: ``step-4`` is committed, the folder not yet fsynced and nothing purged;
``mid_purge``: ``keep_latest_k`` deletes ``step-2``: renamed aside and half deleted. At the pause the worker creates
READY_FILE and sleeps until killed.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from fault_model import use_dropout_model

import titanlike.checkpoint.manager as ckpt  # where the manager looks its helpers up
from titanlike.config import load_config
from titanlike.training.trainer import Trainer


def freeze(ready: Path) -> None:
    ready.touch()
    while True:
        time.sleep(1)


def main() -> None:
    pause, ready, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    use_dropout_model()
    if pause == "before_rename":
        merge = ckpt.merge_checksums

        def merge_then_freeze(folder):
            merge(folder)
            if folder.name.startswith("step-4."):
                freeze(ready)

        ckpt.merge_checksums = merge_then_freeze
    elif pause == "after_rename":
        fsync_dir = ckpt.fsync_dir

        def freeze_after_rename(folder):
            if (folder / "step-4").is_dir():
                freeze(ready)
            fsync_dir(folder)

        ckpt.fsync_dir = freeze_after_rename
    elif pause == "mid_purge":
        rmtree = shutil.rmtree

        def half_delete(path, *args, **kwargs):
            path = Path(path)
            if ".trash-" in path.name:
                for f in sorted(path.iterdir())[:2]:
                    f.unlink()
                freeze(ready)
            rmtree(path, *args, **kwargs)

        shutil.rmtree = half_delete
    else:
        raise SystemExit(f"unknown pause point {pause!r}")
    Trainer(load_config(argv, world_size=1)).train()
    raise SystemExit("the worker was not killed at its pause point")


if __name__ == "__main__":
    main()
