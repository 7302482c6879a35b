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
import shutil
import time

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
def operation(what: str, *, rank: int, world_size: int, timeout_s: float, enabled: bool = True):
    """Run a phase of a distributed job; a collective failure inside becomes one :class:`CollectiveFailure` line
    naming this rank, ``what`` and the ranks that stopped answering. Other errors pass through unchanged."""
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
        raise CollectiveFailure(f"rank {rank}: {what} failed: {who} ({type(e).__name__}: {first_line(e)})") from e


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
