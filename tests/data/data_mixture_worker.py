"""Training jobs of two forked ranks, one after the other, for tests/data/test_data_mixture_dist.py.

    python tests/data/data_mixture_worker.py OUT_DIR JOB [JOB ...] -- <train.py options>

A JOB is ``NAME`` (a fresh run into OUT_DIR/NAME) or ``NAME:FROM:STEP`` (OUT_DIR/FROM's checkpoint step-STEP is
copied into OUT_DIR/NAME first, so that the run resumes from it). Each job's two ranks run
``titanlike.training.trainer.main`` exactly as under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the
environment: the trainer creates the process group itself), forked from this process, which imported the trainer
once; rank r's output goes to OUT_DIR/NAME/rank<r>.log. Exits non-zero when a rank of a job fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import unused_port  # noqa: E402

import titanlike.training.trainer as trainer_module  # noqa: E402


def _rank(rank: int, port: int, dump: Path, argv: list[str]) -> None:
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
    out, jobs, argv = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    ctx = mp.get_context("fork")
    for job in jobs:
        name, _, resume = job.partition(":")
        dump = out / name
        dump.mkdir(parents=True, exist_ok=True)
        if resume:
            source, step = resume.split(":")
            src = out / source / "checkpoint" / f"step-{step}"
            shutil.copytree(src, dump / "checkpoint" / src.name)
        port = unused_port()
        procs = [ctx.Process(target=_rank, args=(r, port, dump, argv)) for r in range(2)]
        for p in procs:
            p.start()
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the other would wait for it
                time.sleep(1.0)
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            print(f"job {name}: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
