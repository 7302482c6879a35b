"""Run a function on N gloo ranks: one fresh interpreter that forks N workers (no torchrun start-up per rank).

A test calls :func:`run_script` with a worker script; the script's ``__main__`` calls :func:`spawn`, which
imports nothing new per rank: the parent imports torch once, hosts a ``TCPStore`` and forks the ranks
before any compute (so no OpenMP pool exists yet). Every rank gets ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` like under torchrun, a gloo process group with a short timeout, one
intra-op thread, and leaves with ``os._exit`` after ``destroy_process_group`` (a plain interpreter exit after
gloo aborts now and then, see docs/facts.md). If a rank fails, the others are killed.

Start-up on the shared 2-core machine: about 3 s for the import plus well under a second per rank, against
5 / 8 / 20 s for torchrun at 2 / 4 / 8 ranks.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def unused_port() -> int:
    """A TCP port for a store that some process binds later (after start-up): free now and *below* the kernel's
    ephemeral range (32768-60999 here), which the OS picks outgoing connections from. A port from ``bind(0)`` is in
    that range, and the gloo connections of jobs running side by side can take it before the store binds it (seen
    in CI: ``EADDRINUSE`` for one of four 2-rank fault jobs)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000")


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a worker subprocess: the repository (titanlike), tests/ (dist_utils) and examples/
    (the README's example) on its path, one intra-op thread unless ``extra`` says otherwise."""
    path = os.pathsep.join(
        p for p in (str(REPO), str(TESTS), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-node job whose store listens on ``port``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _rank_main(fn, rank: int, world_size: int, port: int, timeout_s: float, errors: str, args: tuple) -> None:
    code = 1
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(torchrun_env(rank, world_size, port))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        fn(rank, world_size, *args)
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        traceback.print_exc()
        sys.stderr.flush()
        # for spawn's summary: when this rank failed, and why (the first failure is the cause, the others follow it)
        Path(errors, f"rank{rank}").write_text(f"{time.time()}\n{traceback.format_exc()}")
    finally:
        sys.stdout.flush()
        os._exit(code)


def spawn(fn: Callable[..., None], world_size: int, *args, timeout_s: float = 60.0) -> int:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return 0 if all succeeded.

    ``timeout_s`` is the gloo timeout: a collective that waits longer (a rank died, or the ranks disagree
    on the sequence of collectives) fails instead of hanging.
    """
    import torch.distributed as dist

    # Fork before anything in this process starts a thread: the TCPStore server runs a background thread, and
    # forking while it holds a lock (malloc's, say) can deadlock a child before it reaches gloo. So pick a free
    # port, fork the ranks, and only then host the store on that port (the clients retry until it is up).
    port = unused_port()
    ctx = mp.get_context("fork")
    errors = tempfile.mkdtemp(prefix="spawn_errors_")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout_s, errors, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    store = dist.TCPStore(  # noqa: F841 (kept alive: the workers' store)
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    failed = False
    killed: set[int] = set()  # the ranks this function killed once another had failed
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            failed = True
            break
        time.sleep(0.05)
    if failed:  # one rank failed: the others would wait for it until the gloo timeout
        time.sleep(1.0)  # let the failing rank's traceback reach stderr
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                killed.add(p.pid)
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        _report_failure(procs, killed, Path(errors))
    shutil.rmtree(errors, ignore_errors=True)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _report_failure(procs, killed: set[int], errors: Path) -> None:
    """The last lines of a failed launch's stderr (what a test's message keeps of it): every rank's exit code (a
    negative one is the signal that killed it, with no traceback: the OOM killer, say) and the traceback of the rank
    that failed first. The others mostly fail after it ("Connection closed by peer") and their tracebacks, printed
    later, would push the cause out of a test's message."""

    def code(p) -> str:
        if p.pid in killed:
            return "killed after another failed"
        return f"{p.exitcode}" + (f" ({signal.Signals(-p.exitcode).name})" if (p.exitcode or 0) < 0 else "")

    codes = ", ".join(f"rank {r}: {code(p)}" for r, p in enumerate(procs))
    failures = sorted(
        (float(text.partition("\n")[0]), path.name, text.partition("\n")[2])
        for path in errors.iterdir()
        for text in [path.read_text()]
    )
    first = f"the first to fail, {failures[0][1]}:\n{failures[0][2][-6000:]}" if failures else "no rank raised"
    print(f"=== spawn: a rank failed; exit codes {codes}; {first}", file=sys.stderr, flush=True)


def tiny_run_args(corpus: str) -> list[str]:
    """The fault tests' quiet small run: 2 rows of 32 tokens of ``corpus`` per rank and step, no validation, no
    TensorBoard, a log line every step."""
    return [
        *("--training.local_batch_size", "2", "--training.seq_len", "32", "--data.path", corpus),
        *("--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
    ]


def run_script(script: str | Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``python script *args`` from the repository root (one thread per process), capturing its output. Past
    ``timeout`` (or on an interrupt) the script **and every process it forked** (a launch's ranks) are killed, then
    ``subprocess.TimeoutExpired`` is raised with the output so far: ranks left running would slow every later test."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the ranks it forks are in it
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_at_pause_points(
    tmp_path_factory,
    worker: Path,
    cwd: Path,
    pauses: list[str],
    args_for: Callable[[Path], list[str]],
    timeout_s: float = 180.0,
) -> dict[str, Path]:
    """Run ``worker PAUSE MARKER *args_for(dump)`` once per pause point, side by side; SIGKILL each as soon as it
    writes its marker (it then sits at that point of a save). Returns pause -> the run's dump folder."""
    import pytest
    import torch

    # The thread count of this process: a different one may change float32 sums, and runs must be bitwise equal.
    env = worker_env(OMP_NUM_THREADS=str(torch.get_num_threads()))
    runs = {}
    for pause in pauses:
        dump = tmp_path_factory.mktemp(f"killed_{pause}")
        proc = subprocess.Popen(
            [sys.executable, str(worker), pause, str(dump / "paused"), *args_for(dump)],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        runs[pause] = (dump, proc)
    deadline = time.monotonic() + timeout_s
    for pause, (dump, proc) in runs.items():
        while not (dump / "paused").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                for _, other in runs.values():
                    other.kill()
                pytest.fail(f"the {pause} worker never reached its pause point:\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
    return {pause: dump for pause, (dump, _) in runs.items()}


def poke_tensor_value(step_dir: Path, fqn: str, value: float, index: int = 0) -> str:
    """Set one element of a checkpoint's stored tensor ``fqn`` (a DCP key: ``model.norm.weight``) to ``value`` in
    place, inside the tensor's data in its data file (the file stays valid and keeps its size), as a flipped memory
    cell or a bad disk would. Returns the data file's name."""
    import io

    import torch

    from titanlike.restricted_unpickle import read_metadata

    md = read_metadata(step_dir)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    f = Path(step_dir) / info.relative_path
    raw = bytearray(f.read_bytes())
    record = bytes(raw[info.offset : info.offset + info.length])
    stored = torch.load(io.BytesIO(record), weights_only=True).contiguous()
    data = record.find(stored.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert data >= 0, f"the data of {fqn} is not stored verbatim in its record"
    size = stored.element_size()
    new = torch.tensor([value], dtype=stored.dtype).view(torch.uint8).numpy().tobytes()
    at = info.offset + data + index * size
    raw[at : at + size] = new
    f.write_bytes(bytes(raw))
    return info.relative_path


def before_step(step: int, action: Callable[[], None], patch=setattr) -> None:
    """Run ``action`` just before the trainer's training step ``step`` (a signal that arrives while that step trains).
    ``patch``: how to replace the trainer's ``train_step`` (pytest's ``monkeypatch.setattr`` to undo it after the
    test; plain ``setattr`` in a worker)."""
    import titanlike.training.trainer as trainer_module

    train_step, calls = trainer_module.train_step, []

    def planted(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            action()
        return train_step(*args, **kwargs)

    patch(trainer_module, "train_step", planted)


def during_the_save_of(step: int, action: Callable[[], None], patch=setattr) -> None:
    """Run ``action`` inside the checkpoint save of ``step``, once this rank's data files are written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def planted(self, plan, planner):
        out = write_data(self, plan, planner)
        if Path(str(self.path)).name.startswith(f"step-{step}."):
            action()
        return out

    patch(FileSystemWriter, "write_data", planted)


def _trainer_rank(rank: int, world_size: int, port: int, dump: Path, argv: list[str], setup=None) -> None:
    log = open(dump / f"rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(torchrun_env(rank, world_size, port))
    code = 1
    try:
        import torch

        from titanlike.training.trainer import main

        torch.set_num_threads(1)
        if setup is not None:  # a fault planted in this rank (tests/fault/sentinel_worker.py)
            setup(rank)
        code = main([*argv, "--job.dump_folder", str(dump)])
    except BaseException:  # noqa: BLE001 - the traceback is the report
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_jobs_then_single(out: Path, jobs: dict[str, list[str]], single: list[str], world_size: int = 2) -> int:
    """Each of ``jobs`` (name -> train.py options) on ``world_size`` forked ranks into ``out/<name>``
    (:func:`run_trainer_job`), then ``single`` in this process into ``out/single``: a worker's main, which imported
    the trainer once. A failed job prints its ranks' log tails and returns 1 before the single run."""
    from titanlike.training.trainer import main as train_main

    for name, argv in jobs.items():
        codes = run_trainer_job(out / name, argv, world_size=world_size)
        if any(codes):
            for r in range(world_size):
                print(f"--- {name} rank {r}:\n{(out / name / f'rank{r}.log').read_text()[-3000:]}", file=sys.stderr)
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    import torch

    torch.set_num_threads(1)
    return train_main([*single, "--job.dump_folder", str(out / "single")])


def run_trainer_job(dump: Path, argv: list[str], world_size: int = 2, setup=None) -> list[int]:
    """``titanlike.training.trainer.main(argv)`` on ``world_size`` forked ranks, exactly as under torchrun (RANK,
    WORLD_SIZE, MASTER_ADDR / MASTER_PORT in the environment: the trainer creates the process group itself), with
    ``--job.dump_folder dump``; rank r's output goes to ``dump/rank<r>.log``. As torchrun does, a rank that fails
    ends the job (the others are killed). Returns the exit codes. Call it from a worker script that imported the
    trainer before (one import for every job; never fork pytest itself). ``setup(rank)`` runs in each rank before
    the trainer (a planted fault)."""
    dump.mkdir(parents=True, exist_ok=True)
    port = unused_port()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_trainer_rank, args=(r, world_size, port, dump, argv, setup)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(1.0)  # let the failing rank write its report
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]
