"""A rank of one fault-tolerant replica group, started by torchrun, for tests/fault/test_replica_groups.py.

    torchrun --nproc_per_node 2 --max-restarts 1 tests/fault/replica_group_worker.py <train.py options>

``titanlike.training.trainer.main`` with, from the environment, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0):

* ``FT_TEST_KILL = "STEP:RANK"``: that rank kills itself with SIGKILL just before its STEP-th training step (kill -9
  of one rank of the group; torchrun then restarts the whole group when it has restarts left), removing
  ``FT_TEST_READY`` first and writing the time to ``FT_TEST_READY.killed``;

and on every attempt:

* ``FT_TEST_WAIT_FOR = PATH``: while fewer than all groups take part in a step and PATH does not exist, each step
  waits 0.3 s first, and the first step and the last three wait for PATH (at most 120 s): the groups start
  together, and a healthy group keeps stepping alone but does not finish the job before the restarted one is back
  (a restart takes 10-30 s on a busy 2-core machine);
* ``FT_TEST_READY = PATH``: written when this group's first quorum starts (a restarted group is built and joining).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from dist_utils import before_step

import titanlike.training.trainer as trainer_module
from titanlike.training.fault_tolerance import ReplicaGroups


def _plant() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = os.environ.get("FT_TEST_KILL")
    if kill and attempt == 0:
        step, rank = (int(v) for v in kill.split(":"))
        if int(os.environ["RANK"]) == rank:

            def die():
                sys.stdout.flush()
                if os.environ.get("FT_TEST_READY"):
                    Path(os.environ["FT_TEST_READY"]).unlink(missing_ok=True)
                    Path(os.environ["FT_TEST_READY"] + ".killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            before_step(step, die)
    ready, wait_for = os.environ.get("FT_TEST_READY"), os.environ.get("FT_TEST_WAIT_FOR")
    begin_step, first = ReplicaGroups.begin_step, []

    def planted(self, step):
        if ready and not first:
            Path(ready).write_text(str(attempt))
            first.append(step)
        out = begin_step(self, step)
        if wait_for and self.participants < self.cfg.fault_tolerance.group_size:
            time.sleep(0.3)
            deadline = time.time() + 120
            edge = step == 0 or step >= self.cfg.training.steps - 3
            while edge and not Path(wait_for).exists() and time.time() < deadline:
                time.sleep(0.1)
        return out

    ReplicaGroups.begin_step = planted


if __name__ == "__main__":
    _plant()
    sys.exit(trainer_module.main(sys.argv[1:]))
