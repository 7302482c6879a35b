"""One job per run folder: a lock on ``job.dump_folder`` and ``checkpoint.folder``, taken by rank 0 before anything
is written.

A second job started into a running job's folders (an overlapping requeue, an accidental resubmit) would interleave
its metrics with the first's and overwrite its checkpoints; it is refused in one line naming the holder (exit 2,
before any process group starts). The lock is a file, ``.titanlike.lock``, created with ``O_CREAT | O_EXCL`` (atomic,
on NFS too) and holding the holder's host, pid, process start and start time; a thread refreshes its modification
time (the heartbeat) every tenth of ``job.stale_lock_seconds``. A lock is stale, and taken over with a printed note,
when its process is gone (same host: the pid is not running, or runs another program since), or when its heartbeat
is older than ``job.stale_lock_seconds`` (another host, e.g. a job killed on a node that died; the check compares
the file's time with this host's clock, so keep the hosts' clocks in sync). The lock is removed when the run ends;
a lock left by a killed run is stale by construction.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from titanlike.config import ConfigError

LOCK_NAME = ".titanlike.lock"


def _process_start(pid: int) -> str | None:
    """The start time of a process on this host (clock ticks since boot, /proc/<pid>/stat field 22), None when
    there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    """The locks of one run's folders (rank 0). :meth:`acquire` takes them all or none; :meth:`release` removes the
    ones still holding this run's token, and the folders the lock itself created if they stayed empty."""

    def __init__(self, folders: list[Path], stale_after_s: float):
        self.folders = list(dict.fromkeys(Path(f).resolve() for f in folders))
        self.stale_after_s = stale_after_s
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex,
        }
        self.held: list[Path] = []
        self.created: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ taking
    def acquire(self) -> RunLock:
        try:
            for folder in self.folders:
                self._acquire_one(folder)
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._heartbeat, name="titanlike-run-lock", daemon=True)
        self._thread.start()
        return self

    def _acquire_one(self, folder: Path) -> None:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # a file in the way, no permission: the folder's own checks report it, nothing to lock
            return
        self.created += missing
        path = folder / LOCK_NAME
        for _ in range(10):  # a takeover races at most a few other takers
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse(path)
                continue
            except OSError:  # not writable: the folder's own checks report it
                return
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held.append(path)
            return
        raise ConfigError(f"job: could not take the lock {path}: other jobs keep taking it over; start one job")

    def _take_over_or_refuse(self, path: Path) -> None:
        holder, age = self._read(path)
        if holder is None and age is None:  # removed meanwhile: try again
            return
        why = self._stale(holder, age)
        if why is None:
            folder = path.parent
            who = (
                f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                if holder
                else "a job whose lock file is being written"
            )
            raise ConfigError(
                f"job: '{folder}' is in use by another job ({who}; its heartbeat {age:.0f} s ago): two jobs in "
                f"one run folder would mix their metrics and checkpoints; wait for it to end or stop it, or choose "
                f"another job.dump_folder / checkpoint.folder (a lock without a heartbeat for "
                f"job.stale_lock_seconds = {self.stale_after_s:g} s is taken over)"
            )
        aside = path.with_name(f"{LOCK_NAME}.stale-{self.me['token'][:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # another taker was first
        taken, _ = self._read(aside)
        if taken != holder:  # renamed a fresh lock another taker had just created: give it back
            os.rename(aside, path)
            return
        aside.unlink(missing_ok=True)
        if why != "this process":
            print(f"job: took over the stale lock of {path.parent} ({why})", flush=True)

    def _read(self, path: Path) -> tuple[dict | None, float | None]:
        try:
            age = time.time() - path.stat().st_mtime
            text = path.read_text()
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:  # being written (or damaged): judged by its age alone
            holder = None
        return (holder if isinstance(holder, dict) else None), age

    def _stale(self, holder: dict | None, age: float) -> str | None:
        """Why the lock of ``holder`` (heartbeat ``age`` seconds ago) can be taken over, None when it is held."""
        if holder is not None and holder.get("host") == self.me["host"]:
            pid = holder.get("pid")
            if isinstance(pid, int):
                if pid == self.me["pid"] and holder.get("process_start") == self.me["process_start"]:
                    return "this process"  # an earlier run in this process that was not closed
                if not _alive(pid):
                    return f"pid {pid} on this host is gone"
                start = _process_start(pid)
                if start is not None and holder.get("process_start") not in (None, start):
                    return f"pid {pid} on this host is another process now"
        if age > self.stale_after_s:
            who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unreadable lock"
            return f"{who}: no heartbeat for {age:.0f} s, job.stale_lock_seconds = {self.stale_after_s:g}"
        return None

    # ------------------------------------------------------------------ holding
    def _heartbeat(self) -> None:
        interval = max(self.stale_after_s / 10, 0.5)
        warned = set()
        while not self._stop.wait(interval):
            for path in self.held:
                holder, _ = self._read(path)
                if holder is None or holder.get("token") != self.me["token"]:
                    if path not in warned:
                        warned.add(path)
                        print(f"job: warning: the lock {path} is no longer this run's (taken over)", flush=True)
                    continue
                try:
                    os.utime(path)
                except OSError:
                    pass

    def release(self) -> None:
        self._stop.set()
        for path in self.held:
            holder, _ = self._read(path)
            if holder is not None and holder.get("token") == self.me["token"]:
                path.unlink(missing_ok=True)
        self.held = []
        # only the folders this lock made, innermost first, and only while they are empty
        for folder in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        self.created = []

    def release_now(self) -> None:
        """From a signal handler just before ``os._exit``: remove this run's lock files (no thread, no printing)."""
        for path in self.held:
            try:
                if json.loads(path.read_text()).get("token") == self.me["token"]:
                    path.unlink()
            except (OSError, ValueError):
                pass
