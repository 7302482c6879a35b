"""2-rank training jobs (``dist_utils.run_trainer_job``, one import of the trainer for all), one after the other, in
which a rank hangs, for tests/fault/test_hang_report.py.

    python tests/fault/hang_worker.py OUT_DIR MODE... -- <train.py options common to all>

Job MODE runs into ``OUT_DIR/MODE`` with the common options plus those of ``OUT_DIR/MODE.args``. At its step 2:

* ``a2a``: rank 1 stops itself (SIGSTOP) inside the expert all-to-all of the dispatch (the first of the step);
* ``p2p``: rank 1 stops itself inside the pipeline's first transfer of the step;
* ``data``: rank 1 stops itself inside the data loading of the step;
* ``mismatch``: before the step, rank 0 issues an all-reduce of 3 numbers and rank 1 an all-gather of 5 on the
  default group (the same sequence slot): a planted bug;
* ``signal``: rank 1 stops itself inside the data loading of the step, and rank 0 (waiting for it, under a long
  ``comm.timeout_seconds``) gets SIGUSR2 2 s later, as from a user; once its verdict is written it leaves.

The rank writes the time it stopped to ``OUT_DIR/MODE/fault_time``; the job's exit codes go to ``codes.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer as trainer_module  # noqa: E402

STEP = 2


def _stop(dump: Path) -> None:
    (dump / "fault_time").write_text(repr(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def _signal_then_leave(dump: Path) -> None:
    """Rank 0 of ``signal``: SIGUSR2 to itself 2 s after rank 1 stopped; exit once the verdict is out."""
    fault = dump / "fault_time"
    while not fault.exists():
        time.sleep(0.05)
    time.sleep(2.0)
    (dump / "signal_time").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGUSR2)
    verdict = dump / "hang" / "verdict.signal.txt"
    deadline = time.time() + 60
    while not verdict.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    os._exit(3)


def plant(mode: str, dump: Path):
    def setup(rank: int) -> None:
        steps = []
        train_step = trainer_module.train_step

        def counting(*args, **kwargs):
            steps.append(1)
            if mode == "mismatch" and len(steps) == STEP:
                import torch
                import torch.distributed as dist

                (dump / "fault_time").write_text(repr(time.time()))
                if rank == 0:
                    dist.all_reduce(torch.zeros(3))
                else:
                    dist.all_gather_into_tensor(torch.zeros(10), torch.zeros(5))
            return train_step(*args, **kwargs)

        trainer_module.train_step = counting
        if mode == "signal" and rank == 0:
            threading.Thread(target=_signal_then_leave, args=(dump,), daemon=True).start()
        if rank != 1:
            return
        if mode == "a2a":
            import torch.distributed._functional_collectives as funcol

            inner = funcol.all_to_all_single_autograd

            def stopping(*args, **kwargs):
                if len(steps) == STEP:
                    _stop(dump)
                return inner(*args, **kwargs)

            funcol.all_to_all_single_autograd = stopping
        elif mode == "p2p":
            from torch.distributed.pipelining import schedules

            inner = schedules._batch_p2p

            def stopping(ops, desc=None):
                if len(steps) == STEP:
                    _stop(dump)
                return inner(ops, desc)

            schedules._batch_p2p = stopping
        elif mode in ("data", "signal"):
            inner = trainer_module.Trainer._next_micro_batches

            def stopping(self, it):
                if self.step == STEP:
                    _stop(dump)
                return inner(self, it)

            trainer_module.Trainer._next_micro_batches = stopping

    return setup


def main() -> int:
    split = sys.argv.index("--")
    out, modes, common = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    for mode in modes:
        dump = out / mode
        dump.mkdir(parents=True, exist_ok=True)
        extra_file = out / f"{mode}.args"
        extra = extra_file.read_text().split() if extra_file.exists() else []
        t0 = time.time()
        codes = run_trainer_job(dump, [*common, *extra], world_size=2, setup=plant(mode, dump))
        (dump / "codes.json").write_text(json.dumps({"codes": codes, "ended": time.time(), "started": t0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
