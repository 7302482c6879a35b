"""Hang reports: when a collective times out (or on ``SIGUSR2``), every rank that can still talk writes one record,
and the first one to get there prints one verdict naming the ranks that are missing, from which collective, where
the others wait, and the likeliest cause.

What a record holds (``<job.dump_folder>/hang/rank<r>.<kind>.json``, kind ``timeout`` or ``signal``, and in the
job's store for the verdict):

* the collectives: torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, set before the process group starts; gloo
  has one since torch 2.7, nccl always): per process group its ranks, its last completed and its pending
  collective (the group's sequence number, the op, the input sizes and dtypes, how long it has waited);
* the pipeline's point-to-point transfers, which gloo's recorder leaves out: recorded here at the seam every
  ``torch.distributed.pipelining`` schedule sends through (``schedules._batch_p2p``), with a sequence number per
  (peer, direction), the sizes and whether each transfer has completed;
* the rank's phase (data / forward / backward / optimizer / checkpoint / validation / evaluation / sdc check) and
  the module it last entered (forward hooks on every module, a hook on each module's output for the backward);
* its Python stack (every thread's, the main thread first).

A rank that is stopped (SIGSTOP), hung in native code or dead cannot write a record; its phase and module are still
known from its *status file* (``<job.dump_folder>/hang/rank<r>.where``): 512 bytes, memory-mapped, rewritten at
every phase or module change (no system call), readable by the other ranks of its node whatever state it is in.

The verdict (``<job.dump_folder>/hang/verdict.<kind>.txt``, printed by the first rank that writes its record): for every
group in which some rank waits, which members never arrived at that collective (and their last phase), members that
issued a *different* collective (op or sizes) in the same sequence slot (a planted bug, or ranks taking different
code paths), members behind (still at an earlier slot of that group); for every pending transfer, the peer that
never sent or never received; and the likeliest cause: a rank that never arrived (stopped, hung or dead), stuck in
data loading or I/O (its last phase data or checkpoint), or mismatched collectives.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

__all__ = ["HangReport", "enable_flight_recorder", "phase", "set_where"]

FR_ENTRIES = "2000"  # the flight recorder's ring of collectives per process
WHERE_BYTES = 512
_KEY = "titanlike/hang/"
DATA_PHASES = ("data", "checkpoint")


def enable_flight_recorder() -> None:
    """torch's flight recorder on every process group created after this (the trainer calls it before the process
    group starts); a value the user set is kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_ENTRIES)


# ---------------------------------------------------------------------------------------------- where a rank is
class _Where:
    """This process's phase and module, mirrored into its memory-mapped status file (when one is open)."""

    def __init__(self):
        self.phase, self.module, self.step, self.since = "start", "", 0, time.time()
        self.map: mmap.mmap | None = None
        self.rank, self.pid = 0, os.getpid()

    def open(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b" " * WHERE_BYTES)
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, WHERE_BYTES)
        finally:
            os.close(fd)
        self.rank, self.pid = rank, os.getpid()
        self.write()

    def set(self, phase: str, module: str | None = None) -> None:
        if phase != self.phase or (module is not None and module != self.module):
            if phase != self.phase:
                self.since = time.time()
            self.phase = phase
            if module is not None:
                self.module = module
            if self.map is not None:
                self.write()

    def write(self) -> None:
        """One line of fields (no JSON: this runs at every module change, 2 us): rank, pid, step, the time the phase
        began, the phase and the module, tab-separated, padded to the file's size."""
        data = f"{self.rank}\t{self.pid}\t{self.step}\t{self.since:.3f}\t{self.phase}\t{self.module[:300]}\n".encode()
        self.map[: len(data)] = data
        self.map[len(data) : len(data) + 1] = b"\n"

    def as_dict(self) -> dict:
        return {"step": self.step, "phase": self.phase, "module": self.module, "since": self.since}


WHERE = _Where()


def set_where(phase: str, module: str | None = None) -> None:
    WHERE.set(phase, module)


@contextlib.contextmanager
def phase(name: str, after: str = "end of step"):
    """Mark a phase of the loop (data, checkpoint, validation, ...); ``after`` follows it."""
    WHERE.set(name, "")
    try:
        yield
    finally:
        WHERE.set(after, "")


def read_where(path: Path) -> dict | None:
    """Another rank's status file (None when it is not readable from here)."""
    for _ in range(3):  # a write may be under way: read again
        try:
            rank, pid, step, since, phase_, module = path.read_bytes().split(b"\n", 1)[0].decode().split("\t")
            return {
                "rank": int(rank),
                "pid": int(pid),
                "step": int(step),
                "since": float(since),
                "phase": phase_,
                "module": module,
            }
        except (OSError, ValueError):
            time.sleep(0.01)
    return None


def install_model_hooks(model_parts) -> list:
    """The forward and the backward of every module set the phase and the module (returns the hook handles)."""
    handles = []

    def pre(name):
        def hook(module, args):
            if torch.compiler.is_compiling():
                return
            in_backward = torch._C._current_graph_task_id() != -1
            WHERE.set("backward (recompute)" if in_backward else "forward", name)

        return hook

    def post(name):
        def hook(module, args, out):
            if torch.compiler.is_compiling() or not torch.is_grad_enabled():
                return
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: WHERE.set("backward", name))

        return hook

    for part in model_parts:
        for name, m in part.named_modules():
            # before FSDP's own pre-hook (its all-gather): a rank waiting there is in this module's forward
            handles.append(m.register_forward_pre_hook(pre(name or "<root>"), prepend=True))
            handles.append(m.register_forward_hook(post(name or "<root>")))
    return handles


def install_optimizer_hooks(optimizer) -> None:
    optimizer.register_step_pre_hook(lambda *a: WHERE.set("optimizer", ""))


# ---------------------------------------------------------------------------------------------- pipeline p2p
class _BoundedWork:
    """A transfer's Work whose ``wait()`` is bounded by the job's timeout (gloo waits for a point-to-point transfer
    without one: a pipeline whose peer stopped hung forever) and remembers a failure (gloo then reports the work
    completed)."""

    def __init__(self, work, item: dict, timeout):
        self._work, self._item, self._timeout = work, item, timeout

    def wait(self, timeout=None):
        try:
            return self._work.wait(timeout or self._timeout)
        except Exception:
            self._item["failed"] = True
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)


class _P2P:
    """The pipeline's transfers, recorded at ``torch.distributed.pipelining.schedules._batch_p2p``."""

    def __init__(self):
        self.seq: Counter = Counter()
        self.recent: list[dict] = []  # the newest 64 transfers, with their Work
        self.installed = False

    def install(self, timeout_s: float) -> None:
        if self.installed:
            return
        try:
            from torch.distributed.pipelining import schedules
        except ImportError:
            return
        inner = getattr(schedules, "_batch_p2p", None)
        if inner is None:
            return
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)

        def recorded(p2p_ops, desc=None):
            items = []
            for op in p2p_ops:
                kind = "send" if op.op is dist.isend else "recv"
                self.seq[(kind, op.peer)] += 1
                items.append(
                    {
                        "op": kind,
                        "peer": op.peer,
                        "seq": self.seq[(kind, op.peer)],
                        "sizes": list(op.tensor.shape),
                        "dtype": str(op.tensor.dtype).removeprefix("torch."),
                        "t": time.time(),
                        "work": None,
                        "failed": False,
                        "where": f"{WHERE.phase} {WHERE.module}".strip(),
                    }
                )
            self.recent += items
            del self.recent[:-64]
            works = inner(p2p_ops, desc)
            if len(works) == len(items):  # one work per op
                for item, w in zip(items, works):
                    item["work"] = w
                return [_BoundedWork(w, item, timeout) for item, w in zip(items, works)]
            for item in items:  # one coalesced work for the batch
                item["work"] = works[0] if works else None
            return [_BoundedWork(w, items[0], timeout) for w in works]

        schedules._batch_p2p = recorded
        self.installed = True

    def state(self) -> dict:
        pending, last = [], {}
        now = time.time()
        for r in self.recent:
            work = r["work"]
            try:
                done = not r["failed"] and (work is None or work.is_completed())
            except RuntimeError:
                done = False
            item = {k: v for k, v in r.items() if k not in ("work", "t", "failed")}
            if done:
                last[f"{r['op']} {r['peer']}"] = item
            else:
                pending.append({**item, "waited_s": round(now - r["t"], 1)})
        return {"pending": pending, "last_completed": list(last.values())}


P2P = _P2P()


# ---------------------------------------------------------------------------------------------- one rank's record
def _group_ranks() -> dict[str, list[int]]:
    """Process group name (as the flight recorder names it) -> its global ranks, for the groups of this rank."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for pg, name in list(c10d._world.pg_names.items()):
        with contextlib.suppress(Exception):
            out[str(name)] = dist.get_process_group_ranks(pg)
    return out


def flight_recorder(timeout_s: float | None = None) -> tuple[list[dict], str | None]:
    """Per process group of this rank: its name, ranks, last completed and pending collective (torch's flight
    recorder); the reason when there is none. gloo retires a collective that failed like one that completed: the
    newest collective of a group that was created at least ``timeout_s`` ago (it waited the whole timeout: no
    collective that completes can) counts as pending."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(True, False, False))
    except Exception as e:  # noqa: BLE001 - no recorder on this build or backend: the rest still helps
        return [], f"no flight recorder ({type(e).__name__}: {str(e)[:120]})"
    ranks_of = _group_ranks()
    newest: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    now = time.time_ns()
    for e in dump.get("entries", []):
        if e.get("is_p2p"):
            continue
        name = str(e["process_group"][0])
        g = groups.setdefault(
            name, {"group": name, "desc": str(e["process_group"][1]), "ranks": ranks_of.get(name, [])}
        )
        item = {
            "seq": e["collective_seq_id"],
            "op": str(e["profiling_name"]).split(":")[-1],
            "sizes": e.get("input_sizes"),
            "dtypes": e.get("input_dtypes"),
            "waited_s": round((now - e["time_created_ns"]) / 1e9, 1),
            "done": bool(e.get("retired") or e.get("state") == "completed"),
        }
        if name not in newest or item["seq"] >= newest[name]["seq"]:
            newest[name] = item
        if item["done"]:
            if "last_completed" not in g or item["seq"] >= g["last_completed"]["seq"]:
                g["last_completed"] = item
        elif "pending" not in g or item["seq"] < g["pending"]["seq"]:
            g["pending"] = item
    # gloo retires a failed collective: the newest one of this rank (none pending, no pipeline transfer after it)
    # that was created at least the timeout ago is the one that failed
    entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
    last = max(entries, key=lambda e: e["time_created_ns"], default=None)
    latest_p2p = max((r["t"] for r in P2P.recent), default=0.0)
    for name, item in newest.items():
        g = groups[name]
        if (
            "pending" not in g
            and timeout_s is not None
            and not any("pending" in x for x in groups.values())
            and last is not None
            and str(last["process_group"][0]) == name
            and last["collective_seq_id"] == item["seq"]
            and last["time_created_ns"] / 1e9 > latest_p2p
            and item["waited_s"] >= timeout_s - 0.5
        ):
            g["pending"] = {**item, "failed": True}
            done = [e for e in dump.get("entries", []) if str(e["process_group"][0]) == name]
            before = [e for e in done if e["collective_seq_id"] < item["seq"]]
            if before:
                b = max(before, key=lambda e: e["collective_seq_id"])
                g["last_completed"] = {
                    "seq": b["collective_seq_id"],
                    "op": str(b["profiling_name"]).split(":")[-1],
                    "sizes": b.get("input_sizes"),
                    "dtypes": b.get("input_dtypes"),
                }
            else:
                g.pop("last_completed", None)
    return list(groups.values()), None


def python_stacks() -> list[str]:
    """Every thread's Python stack, the main thread first (the innermost frames last)."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: i != main):
        lines = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frames[ident])[-14:]]
        name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
        out.append(f"thread {name}: " + " > ".join(lines))
    return out[:4]


def build_record(rank: int, why: str, timeout_s: float | None = None) -> dict:
    groups, note = flight_recorder(timeout_s)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "why": why,
        "where": WHERE.as_dict(),
        "collectives": groups,
        "collectives_note": note,
        "p2p": P2P.state(),
        "stacks": python_stacks(),
    }


# ---------------------------------------------------------------------------------------------- the verdict
def _fmt_coll(c: dict) -> str:
    sizes = c.get("sizes")
    return f"{c['op']} #{c['seq']} (sizes {sizes}, {'/'.join(c.get('dtypes') or [])})"


def _last_seen(where: dict | None) -> str:
    if not where:
        return "its status file is not readable from here (another node)"
    mod = f" in {where['module']}" if where.get("module") else ""
    age = time.time() - float(where.get("since", time.time()))
    return f"its last phase: {where['phase']}{mod} at step {where.get('step')}, entered {age:.1f} s before the report"


def _phase(where: dict) -> str:
    return f"{where['phase']} {where['module']}".strip()


def _cause(where: dict | None) -> str:
    if where and str(where.get("phase")) in DATA_PHASES:
        return "stuck in data loading or I/O" if where["phase"] == "data" else "stuck in checkpoint I/O"
    return "stopped, hung or dead"


def verdict(records: dict[int, dict], wheres: dict[int, dict | None], world_size: int) -> list[str]:
    """The verdict's lines from the live ranks' ``records`` (rank -> record) and every rank's status file."""
    lines: list[str] = []
    silent = [r for r in range(world_size) if r not in records]
    groups: dict[tuple, dict[int, dict]] = {}
    for r, rec in records.items():
        for g in rec.get("collectives", []):
            groups.setdefault((g["group"], tuple(g["ranks"])), {})[r] = g
    for (name, ranks), members in sorted(groups.items(), key=lambda kv: kv[0][1]):
        waiting = {r: g["pending"] for r, g in members.items() if g.get("pending")}
        if not waiting:
            continue
        label = f"group {name} (ranks {list(ranks) or '?'})"
        slots = Counter(p["seq"] for p in waiting.values())
        seq = max(slots)  # the furthest slot anyone waits in
        at = {r: p for r, p in waiting.items() if p["seq"] == seq}
        kinds = Counter((p["op"], json.dumps(p["sizes"]), json.dumps(p.get("dtypes"))) for p in at.values())
        if len(kinds) > 1:
            shown = "; ".join(f"rank {r}: {_fmt_coll(p)}" for r, p in sorted(at.items()))
            lines.append(
                f"mismatched collectives in the same slot #{seq} of {label}: {shown} (ranks issued different "
                f"collectives in the same order position: different code paths or a planted bug)"
            )
        ref = next(iter(at.values()))
        waiters = ("rank " if len(at) == 1 else "ranks ") + ", ".join(map(str, sorted(at)))
        wait = "waits" if len(at) == 1 else "wait"
        for r in ranks or []:
            if r in at:
                continue
            if r in records:
                mine = members.get(r, {})
                p, done = mine.get("pending"), mine.get("last_completed")
                w = records[r]["where"]
                if p:
                    lines.append(
                        f"rank {r} waits at {_fmt_coll(p)} of {label} while {waiters} {wait} at "
                        f"{_fmt_coll(ref)}: it is behind (phase {_phase(w)})"
                    )
                else:
                    last = f"its last there: #{done['seq']} {done['op']}" if done else "none done there yet"
                    lines.append(
                        f"rank {r} did not reach {_fmt_coll(ref)} of {label} ({last}); it is alive in phase "
                        f"{_phase(w)}, {_cause(w)}"
                    )
            else:
                where = wheres.get(r)
                lines.append(
                    f"rank {r} never arrived at {_fmt_coll(ref)} of {label}, where {waiters} {wait} "
                    f"({_phase(records[min(at)]['where'])}, "
                    f"{max(p['waited_s'] for p in at.values())} s); rank {r} is {_cause(where)}: {_last_seen(where)}"
                )
    for r, rec in sorted(records.items()):
        for p in rec.get("p2p", {}).get("pending", []):
            peer = p["peer"]
            if peer in records and any(
                q["peer"] == r and q["op"] != p["op"] for q in records[peer].get("p2p", {}).get("pending", [])
            ):
                continue  # both ends posted: a slow transfer, not a missing peer
            verb = "send to" if p["op"] == "send" else "receive from"
            state = (
                f"rank {peer} is {_cause(wheres.get(peer))}: {_last_seen(wheres.get(peer))}"
                if peer not in records
                else f"rank {peer} is alive in phase {_phase(records[peer]['where'])} without the matching transfer"
            )
            lines.append(
                f"rank {r} waits to {verb} rank {peer} (pipeline p2p {p['op']} #{p['seq']} with rank {peer}, "
                f"sizes {p['sizes']} {p['dtype']}, in {p['where']}, {p['waited_s']} s); {state}"
            )
    if not lines:
        if silent:
            lines.append(
                f"rank(s) {', '.join(map(str, silent))} wrote no record: "
                + "; ".join(f"rank {r} is {_cause(wheres.get(r))}: {_last_seen(wheres.get(r))}" for r in silent)
            )
        else:
            lines.append("every rank answered and none waits in a collective the report can see")
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------------------------------------- the report
class HangReport:
    """One per process (the trainer's): the status file, the hooks, and :meth:`report` on a failed collective."""

    def __init__(self, dump_folder, rank: int, world_size: int, timeout_s: float, grace_s: float = 3.0):
        self.folder = Path(dump_folder) / "hang"
        self.rank, self.world_size, self.timeout_s, self.grace_s = rank, world_size, timeout_s, grace_s
        self.reported: set[str] = set()  # one report per kind (a timeout, a signal) and process
        WHERE.open(self.folder / f"rank{rank}.where", rank)
        P2P.install(timeout_s)

    def install(self, model_parts, optimizer) -> None:
        install_model_hooks(model_parts)
        install_optimizer_hooks(optimizer)
        self.install_signal()

    def install_signal(self, signum: int = signal.SIGUSR2) -> bool:
        """``signum`` writes a report at once, even while the main thread waits inside a collective (native code,
        where Python's own handlers do not run until it returns): the handler's C half writes the signal's number
        into a pipe (``signal.set_wakeup_fd``) that a watcher thread reads. Main thread only; False when another
        wakeup fd is set already (asyncio's, say): then the signal is left alone."""
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return False
        if previous != -1:  # someone else's: give it back
            signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return False
        signal.signal(signum, lambda *_: None)  # the Python half: nothing (the watcher does the work)

        def watch():
            while True:
                try:
                    got = os.read(r, 64)
                except OSError:
                    return
                if signum in got:
                    try:
                        self.report(f"rank {self.rank}: {signal.Signals(signum).name} received", kind="signal")
                    except Exception as e:  # noqa: BLE001 - say so; the run goes on
                        print(f"hang report on {signal.Signals(signum).name} failed: {e!r}", file=sys.stderr)

        threading.Thread(target=watch, name="titanlike-hang-report", daemon=True).start()
        return True

    def _store(self, kind: str):
        import datetime

        import torch.distributed as dist

        store = dist.PrefixStore(f"{_KEY}{kind}/", dist.distributed_c10d._get_default_store())
        store.set_timeout(datetime.timedelta(seconds=self.grace_s))
        return store

    def report(self, why: str, alive: list[int] | None = None, kind: str = "timeout") -> str | None:
        """Write this rank's record (file and store); the first rank here writes and prints the verdict once the
        records of the ``alive`` ranks are in (at most ``grace_s``; None: every rank), the
        others wait for it as long, and the first waits until they have read it (rank 0 hosts the store: leaving
        would take it down). Returns the verdict's path and first line."""
        if kind in self.reported:
            return None
        self.reported.add(kind)
        record = build_record(self.rank, why, self.timeout_s if kind == "timeout" else None)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{self.rank}.{kind}.json").write_text(json.dumps(record, indent=1, default=str))
        path = self.folder / f"verdict.{kind}.txt"
        try:
            store = self._store(kind)
            store.set(f"record/{self.rank}", json.dumps(record, default=str))
            first = store.add("reporters", 1) == 1
            expect = set(alive if alive is not None else range(self.world_size)) | {self.rank}
            deadline = time.monotonic() + self.grace_s
            if not first:
                while time.monotonic() < deadline + self.grace_s and not store.check(["verdict"]):
                    time.sleep(0.05)
                if not store.check(["verdict"]):
                    return f"{path}: not written in time"
                line = store.get("verdict").decode().splitlines()[1].strip()
                store.add("read", 1)
                return f"{path}: {line}"
            while time.monotonic() < deadline and not all(store.check([f"record/{r}"]) for r in expect):
                time.sleep(0.05)
            records = {
                r: json.loads(store.get(f"record/{r}")) for r in range(self.world_size) if store.check([f"record/{r}"])
            }
        except Exception as e:  # noqa: BLE001 - the store is gone: this rank's record alone, in a file of its own
            records, store = {self.rank: record}, None
            path = self.folder / f"verdict.{kind}.rank{self.rank}.txt"
            print(f"hang report: the job's store does not answer ({type(e).__name__}); this rank's record only")
        wheres = {r: read_where(self.folder / f"rank{r}.where") for r in range(self.world_size)}
        lines = verdict(records, wheres, self.world_size)
        text = (
            f"hang report ({why}; records from ranks {sorted(records)} of {self.world_size}, in {self.folder}):\n"
            + "\n".join(f"  {ln}" for ln in lines)
        )
        path.write_text(text + "\n")
        print(text, file=sys.stderr, flush=True)
        if store is not None:
            with contextlib.suppress(Exception):
                store.set("verdict", text)
                readers = len(records) - 1
                until = time.monotonic() + self.grace_s
                while readers and time.monotonic() < until and int(store.add("read", 0)) < readers:
                    time.sleep(0.05)
        return f"{path}: {lines[0]}"
