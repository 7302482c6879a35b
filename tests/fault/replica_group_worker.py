"""A rank of one fault-tolerant replica group, started by torchrun, for tests/fault/test_replica_groups.py.

    torchrun --nproc_per_node 2 --max-restarts 1 tests/fault/replica_group_worker.py <train.py options>

``titanlike.training.trainer.main`` with, from the environment:

* ``FT_TEST_KILL = "STEP:RANK"`` (first attempt only, ``TORCHELASTIC_RESTART_COUNT`` 0): that rank kills itself
  with SIGKILL just before its STEP-th training step (kill -9 of one rank of the group; torchrun then restarts the
  whole group when it has restarts left), removing ``FT_TEST_READY`` first and writing the time to
  ``FT_TEST_READY.killed``;
* ``FT_TEST_READY = PATH``: written just before this group's first quorum (the group is built and joining);
* ``FT_TEST_PEER_READY = PATH``: the first quorum waits for PATH (at most 120 s): the groups start together;
* ``FT_TEST_HOLD_FOR = PATH``: while fewer than all groups take part in a step and PATH does not exist, each step
  waits 0.3 s first, and the last three wait for PATH (at most 120 s): a healthy group keeps stepping alone but does
  not finish the job before the restarted one is back (a restart takes 10-30 s on a busy 2-core machine);
* ``FT_TEST_PAUSE = PATH``: once all groups take part again after some step without them, write ``PATH`` and wait
  (at most 120 s) for ``PATH.go`` before the next quorum (the test stops the lighthouse meanwhile).
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


def _wait_for(path: Path, seconds: float = 120.0) -> None:
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline:
        time.sleep(0.1)


def _plant_kill(attempt: int) -> None:
    kill, ready = os.environ.get("FT_TEST_KILL"), os.environ.get("FT_TEST_READY")
    if not kill or attempt:
        return
    step, rank = (int(v) for v in kill.split(":"))
    if int(os.environ["RANK"]) != rank:
        return

    def die():
        sys.stdout.flush()
        if ready:
            Path(ready).unlink(missing_ok=True)
            Path(ready + ".killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    before_step(step, die)


def _plant() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _plant_kill(attempt)
    ready, peer, hold, pause = (
        os.environ.get(k) for k in ("FT_TEST_READY", "FT_TEST_PEER_READY", "FT_TEST_HOLD_FOR", "FT_TEST_PAUSE")
    )
    begin_step, calls, was_alone = ReplicaGroups.begin_step, [], []

    def planted(self, step):
        if pause and was_alone and self.participants == self.cfg.fault_tolerance.group_size:
            Path(pause).write_text(str(step))
            _wait_for(Path(pause + ".go"))
        if not calls:
            if ready:
                Path(ready).write_text(str(attempt))
            if peer:
                _wait_for(Path(peer))
        out = begin_step(self, step)
        calls.append(step)
        if self.participants < self.cfg.fault_tolerance.group_size:
            if len(calls) > 1:
                was_alone.append(step)
            if hold:
                time.sleep(0.3)
                if step >= self.cfg.training.steps - 3:
                    _wait_for(Path(hold))
        return out

    ReplicaGroups.begin_step = planted


if __name__ == "__main__":
    _plant()
    sys.exit(trainer_module.main(sys.argv[1:]))
