"""A 3-rank launch for tests/test_spawn.py where one rank fails: ``raise`` (rank 1 raises, the others then fail in
an all-reduce) or ``kill`` (rank 2 ends itself with SIGKILL, as the OOM killer would); or ``hang`` (every rank
sleeps, writing its pid to the file named after the mode, until it is killed).

    python tests/spawn_fault_worker.py raise|kill|hang [PIDS_FILE]
"""

import os
import signal
import sys
import time

from dist_utils import spawn


def _rank(rank: int, world_size: int, mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "hang":
        with open(sys.argv[2], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(600)
    if mode == "raise" and rank == 1:
        raise ValueError("planted failure on rank 1")
    if mode == "kill" and rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    sys.exit(spawn(_rank, 3, sys.argv[1], timeout_s=20))
