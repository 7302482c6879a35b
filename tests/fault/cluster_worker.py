"""``train.py`` with one planted event, for tests/fault/test_faults.py: every rank runs
``titanlike.training.trainer.main`` on the model that draws random numbers every step (tests/fault_model.py, as
the tests' in-process runs do) and exits with its code.

    python tests/fault/cluster_worker.py EVENT <train.py options>

EVENT (``-`` for none):

* ``pause:STEP:FILE``: rank 0 writes FILE.paused before training step STEP and waits until FILE exists (a job
  that is running while the test starts another one into its folders);
* ``second_signal:STEP``: the rank signals itself with SIGTERM before step STEP, and again inside the save of that
  step once its data files are written (the duplicate window set to 0: every further signal counts);
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from dist_utils import before_step, during_the_save_of
from fault_model import use_dropout_model

import titanlike.training.trainer as trainer_module


def main() -> int:
    event, argv = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    kind, *params = event.split(":") if event != "-" else ["-"]
    if kind == "pause" and rank == 0:
        step, go = int(params[0]), Path(params[1])

        def pause():
            Path(f"{go}.paused").touch()
            while not go.exists():
                time.sleep(0.05)

        before_step(step, pause)
    elif kind == "second_signal":
        import titanlike.training.exit_signals as exit_signals

        exit_signals.DUPLICATE_WINDOW_S = 0.0
        step = int(params[0])
        before_step(step, lambda: os.kill(os.getpid(), signal.SIGTERM))
        during_the_save_of(step, lambda: os.kill(os.getpid(), signal.SIGTERM))
    use_dropout_model()
    return trainer_module.main(argv)


if __name__ == "__main__":
    sys.exit(main())
