"""A 3-rank launch where one rank fails, for tests/test_spawn.py: ``raise`` (rank 1 raises, the others then fail in
an all-reduce) or ``kill`` (rank 2 ends itself with SIGKILL, as the OOM killer would).

    python tests/spawn_fault_worker.py raise|kill
"""

import os
import signal
import sys
import time

from dist_utils import spawn


def _rank(rank: int, world_size: int, mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "raise" and rank == 1:
        raise ValueError("planted failure on rank 1")
    if mode == "kill" and rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    sys.exit(spawn(_rank, 3, sys.argv[1], timeout_s=20))
