"""Fork N gloo ranks on this host (no torchrun), run a function on each, bring rank 0's answer back.

The parent imports torch once, picks a store port below the ephemeral range, forks the ranks before any thread
exists (the store's server thread would otherwise be forked mid-lock), then hosts the ``TCPStore``. Each rank runs
``fn(rank, world_size, *args)``, which returns ``(exit code, text)`` on rank 0; a rank that fails writes its
traceback, the others are killed, and the launch returns code 3 with the first failure's traceback.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

__all__ = ["run_ranks"]


def _free_port() -> int:
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000")


def _rank(fn, rank: int, world: int, port: int, timeout_s: float, out: str, args: tuple) -> None:
    code = 1
    try:
        import logging

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # a layout that raises inside a DTensor op: torch logs the failed shape check at ERROR before raising it (the
        # report names it in one line); FSDP x TP full_tensor() warns that it gathers one mesh dim at a time
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = fn(rank, world, *args)
        if rank == 0:
            Path(out, "result.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported by the parent
        Path(out, f"error{rank}").write_text(f"{time.time()}\n{traceback.format_exc()}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(fn: Callable[..., tuple[int, str]], world: int, *args, timeout_s: float = 60.0) -> tuple[int, str]:
    """``fn(rank, world, *args)`` on ``world`` forked gloo ranks; rank 0's ``(code, text)``, or ``(3, traceback)``."""
    import torch.distributed as dist

    port = _free_port()
    out = tempfile.mkdtemp(prefix="titanlike_localize_")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(fn, r, world, port, timeout_s, out, args)) for r in range(world)]
    for p in procs:
        p.start()
    store = dist.TCPStore(  # noqa: F841 - the ranks' store, alive until they are done
        "127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(1.0)
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    result = Path(out, "result.json")
    errors = sorted(
        (float(t.partition("\n")[0]), t.partition("\n")[2]) for f in Path(out).glob("error*") for t in [f.read_text()]
    )
    try:
        if result.exists() and all(p.exitcode == 0 for p in procs):
            code, text = json.loads(result.read_text())
            return int(code), text
        first = (
            errors[0][1]
            if errors
            else "a rank died without a traceback: "
            + ", ".join(f"rank {r}: exit {p.exitcode}" for r, p in enumerate(procs))
        )
        return 3, f"error: the localiser failed on a rank:\n{first}"
    finally:
        for f in Path(out).iterdir():
            f.unlink()
        os.rmdir(out)
