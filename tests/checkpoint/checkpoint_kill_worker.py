"""Run the Trainer in one process and freeze inside the save of step 4 (or of a seed checkpoint's step-0), for
tests/test_checkpoint.py to kill -9.

    python tests/checkpoint_kill_worker.py {write_data|finish} READY_FILE <train.py options>

``write_data``: after this rank's data files are written, before DCP's .metadata; ``finish``: after the .metadata
(DCP's checkpoint is complete) but before titanlike commits it by renaming the folder. At the pause the worker
creates READY_FILE and sleeps until killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from titanlike.config import load_config
from titanlike.training.trainer import Trainer


def freeze_at(method: str, ready: Path, when) -> None:
    original = getattr(FileSystemWriter, method)

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if when(self):
            if method == "write_data":
                out.wait()  # the writes are done (a completed future)
            ready.touch()
            while True:
                time.sleep(1)
        return out

    setattr(FileSystemWriter, method, wrapped)


def main() -> None:
    pause, ready, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    # step 4 of a training run, or the step-0 of a seed-checkpoint run
    freeze_at(pause, ready, lambda writer: Path(str(writer.path)).name.startswith(("step-4.", "step-0.")))
    Trainer(load_config(argv, world_size=1)).train()
    raise SystemExit("the worker was not killed at its pause point")


if __name__ == "__main__":
    main()
