"""2-rank training jobs with one faulty rank, for tests/test_checkpoint_dist.py.

    python tests/checkpoint_fault_worker.py OUT_DIR MODE... -- <train.py options>

For every MODE, side by side, a job of two forked ranks runs ``titanlike.training.trainer.main`` exactly as under
torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment, so the trainer creates the process
group with ``comm.timeout_seconds``), with ``--job.dump_folder OUT_DIR/MODE``. Rank 1 is faulty (``none``: no
fault, a reference job):

* ``hang_at_save``: it stops answering (sleeps) when it should join the checkpoint save of step 2;
* ``hang_in_step``: it sleeps before training step 3, so rank 0 waits in the step's first collective;
* ``exit_in_step``: it leaves with exit code 0 before training step 3, as if a bug returned early;
* ``sigstop_in_save``: it stops itself with SIGSTOP inside the checkpoint save of step 2, once its data files are
  written (rank 0 then waits for it in DCP's gather of the write results).

Rank 1 writes the time it stopped to ``OUT_DIR/MODE/fault_time``. Like torchrun, this launcher ends a job as soon as
a rank fails, killing the rest; it writes ``OUT_DIR/MODE/job.json`` (exit codes, seconds from the fault to the end
of the job), and each rank's output goes to ``OUT_DIR/MODE/rank<r>.log``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import unused_port  # noqa: E402

import titanlike.training.trainer as trainer_module  # noqa: E402
from titanlike.checkpoint import CheckpointManager  # noqa: E402


def _stop(mode: str, dump: Path) -> None:
    (dump / "fault_time").write_text(repr(time.time()))
    if mode == "sigstop_in_save":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode.startswith("hang"):
        time.sleep(3600)
    sys.stdout.flush()
    os._exit(0)


def _make_faulty(mode: str, dump: Path) -> None:
    if mode == "none":  # an uninterrupted job (a reference)
        return
    if mode == "hang_at_save":
        save = CheckpointManager.save

        def faulty_save(self, step):
            if step == 2:
                _stop(mode, dump)
            return save(self, step)

        CheckpointManager.save = faulty_save
    elif mode == "sigstop_in_save":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def stopping_write_data(self, plan, planner):
            out = write_data(self, plan, planner)
            if Path(str(self.path)).name.startswith("step-2."):
                out.wait()
                _stop(mode, dump)
            return out

        FileSystemWriter.write_data = stopping_write_data
    else:
        train_step, calls = trainer_module.train_step, []

        def faulty_step(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                _stop(mode, dump)
            return train_step(*args, **kwargs)

        trainer_module.train_step = faulty_step


def _rank(rank: int, port: int, mode: str, dump: Path, argv: list[str]) -> None:
    log = open(dump / f"rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = 1
    try:
        import torch

        torch.set_num_threads(1)
        if rank == 1:
            _make_faulty(mode, dump)
        code = trainer_module.main([*argv, "--job.dump_folder", str(dump)])
    except BaseException:  # noqa: BLE001 - the traceback is the report
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    split = sys.argv.index("--")
    out, modes, argv = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    ctx = mp.get_context("fork")
    jobs = {}
    for mode in modes:
        dump = out / mode
        dump.mkdir(parents=True, exist_ok=True)
        port = unused_port()
        procs = [ctx.Process(target=_rank, args=(r, port, mode, dump, argv)) for r in range(2)]
        for p in procs:
            p.start()
        jobs[mode] = (dump, procs)
    running = set(modes)
    while running:
        for mode in list(running):
            dump, procs = jobs[mode]
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or all(p.exitcode is not None for p in procs):
                ended = time.time()
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                    p.join()
                fault = dump / "fault_time"
                (dump / "job.json").write_text(
                    json.dumps(
                        {
                            "exit_codes": [p.exitcode for p in procs],
                            "seconds_after_fault": ended - float(fault.read_text()) if fault.exists() else None,
                        }
                    )
                )
                running.discard(mode)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
