"""Faults of a distributed job: every collective bounded, and a failed one reported as one line naming the ranks
that stopped answering and the operation that was waiting for them.

* :func:`bound_process_groups` gives every process group this rank belongs to the same timeout,
  ``comm.timeout_seconds`` (``new_group`` and ``DeviceMesh`` give a gloo group torch's default of 30 minutes
  unless told otherwise);
* :func:`operation` wraps a phase of the job (a training step, a checkpoint save, ...): when a collective in it
  fails (a timeout, a connection reset by a dead peer), every rank that got the error marks itself alive in the
  job's store, waits a few seconds for the others to do the same, and raises :class:`CollectiveFailure`
  ``rank 0: the checkpoint save of step 2 failed: rank 1 did not answer within 5 s (... Timed out waiting 5000ms
  for recv operation ...)``. A rank that is stopped (SIGSTOP), hung or dead cannot mark itself, so it is the one
  named.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from titanlike.errors import ConfigError

# Words of the errors a collective raises when a peer is gone (gloo, nccl, the store, DCP's gathered failures).
_COMM_WORDS = (
    "timed out",
    "timeout",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "gloo",
    "nccl",
    "monitoredbarrier",
    "socket",
    "by peer",
)
_ALIVE_PREFIX = "titanlike/alive/"
GRACE_S = 3.0  # how long a failed rank waits for the others to report in before naming the silent ones


class ReportedError(RuntimeError):
    """An error whose message is already the one line to print (the job then ends with exit code 1)."""


class CollectiveFailure(ReportedError):
    """A collective failed because a rank stopped answering; the message is one line naming it."""


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` from torchrun's environment, which also comes back after torchrun restarts the
    workers (``--max-restarts``).

    torchrun's agent hosts the store the workers meet in (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it across
    restarts, with the previous attempt's keys in it (torch 2.13 assumes a new store per attempt): a restarted rank
    that reads a peer's address before the peer rewrote it connects to the dead process's port, and gloo fails with
    ``connectFullMesh ... Connection refused`` (docs/facts.md). Each attempt here meets under a prefix of its own
    (``TORCHELASTIC_RESTART_COUNT``), so no attempt reads another's keys. Outside torchrun: the plain env:// start."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"titanlike/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def bound_process_groups(timeout: datetime.timedelta) -> int:
    """Set ``timeout`` on every process group this rank is in (the default one included); return how many."""
    from torch.distributed import distributed_c10d as c10d

    n = 0
    for pg in list(c10d._world.pg_map):
        if pg is None or c10d._rank_not_in_group(pg):
            continue
        with contextlib.suppress(ValueError, AssertionError, RuntimeError):
            c10d._set_pg_timeout(timeout, pg)
            n += 1
    return n


def group_timeout_seconds(pg) -> float | None:
    """The timeout of a gloo group's backend (for tests), None when it cannot be read."""
    import torch

    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def is_comm_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) looks like a failed collective rather than a bug in this rank."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, ReportedError, ConfigError)):
        return False
    if isinstance(exc, dist.DistError):
        return True
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: judge the ranks' own exceptions, not its traceback
        return any(is_comm_failure(f[0] if isinstance(f, tuple) else f) for f in failures.values())
    if any(w in str(exc).lower() for w in _COMM_WORDS):
        return True
    nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return nxt is not None and is_comm_failure(nxt)


def exceptions_in(exc: BaseException):
    """``exc`` and every exception it wraps: causes, contexts, and the ranks' failures DCP gathers into one
    CheckpointException (in rank order)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        todo += [e.__cause__, e.__context__]


def failure_of(exc: BaseException, kind: type) -> str | None:
    """The message of the first exception of type ``kind`` in ``exc`` or what it wraps (None when there is none)."""
    return next((str(e) for e in exceptions_in(exc) if isinstance(e, kind)), None)


def silent_ranks(rank: int, world_size: int, grace_s: float = GRACE_S) -> list[int] | None:
    """Mark this rank alive in the job's store, wait up to ``grace_s`` for every other rank to do the same, and
    return the ranks that did not (None when the store itself does not answer)."""
    try:
        store = dist.PrefixStore(_ALIVE_PREFIX, dist.distributed_c10d._get_default_store())
        store.set_timeout(datetime.timedelta(seconds=grace_s))
        store.set(str(rank), "1")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world_size) if r != rank and not store.check([str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is gone too (its host died): nothing more to learn
        return None


def first_line(exc: BaseException) -> str:
    """The most telling line of an exception: DCP's gathered failures end with the root cause."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def operation(what: str, *, rank: int, world_size: int, timeout_s: float, enabled: bool = True, report=None):
    """Run a phase of a distributed job; a collective failure inside becomes one :class:`CollectiveFailure` line
    naming this rank, ``what`` and the ranks that stopped answering. Other errors pass through unchanged.
    ``report(why, alive_ranks)`` (the trainer's hang report, titanlike/hang.py) writes this rank's record and, on the
    first rank there, the verdict; its one-line summary ends the message."""
    try:
        yield
    except BaseException as e:
        if not enabled or world_size <= 1 or not is_comm_failure(e):
            raise
        missing = silent_ranks(rank, world_size)
        if missing:
            who = (
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer within "
                f"{timeout_s:g} s (stopped, hung or dead)"
            )
        elif missing is None:
            who = "the job's store does not answer either (the rank hosting it is gone)"
        else:
            who = "every rank is still alive"
        summary = None
        if report is not None:
            alive = None if missing is None else [r for r in range(world_size) if r not in missing]
            summary = report(f"rank {rank}: {what} failed: {first_line(e)}", alive)
        raise CollectiveFailure(
            f"rank {rank}: {what} failed: {who} ({type(e).__name__}: {first_line(e)})"
            + (f"; hang report {summary}" if summary else "")
        ) from e


def job_operation(job, what: str):
    """:func:`operation` for an object holding its job's ``rank``, ``world_size``, ``timeout`` (a timedelta) and
    ``distributed`` flag (the trainer, the checkpoint manager)."""
    return operation(
        what,
        rank=job.rank,
        world_size=job.world_size,
        timeout_s=job.timeout.total_seconds(),
        enabled=job.distributed,
        report=getattr(getattr(job, "hang_report", None), "report", None),
    )


def first_non_finite(named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity (None: all finite). One fused norm
    per tensor (``torch._foreach_norm``, one kernel group on a GPU: non-finite when an element is; the 2-norm, which
    reads at 10.7 GB/s on one CPU core here against 3.9 for the 1-norm); only the tensors whose norm is not finite
    are checked element by element (a finite tensor's norm can overflow)."""
    named = [(k, t.detach()) for k, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not named:
        return None
    norms = torch.stack([n.float() for n in torch._foreach_norm([t for _, t in named], 2)]).cpu()
    suspects = [named[i] for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
    return next((k for k, t in suspects if not bool(torch.isfinite(t).all())), None)


def free_space(path) -> str:
    """'12.3 GiB free' on the file system of ``path`` (or its nearest existing parent)."""
    from pathlib import Path

    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError as e:
        return f"free space unknown ({e.strerror})"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free"
    return f"{free} bytes free"
