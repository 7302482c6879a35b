"""A job as a cluster runs it: the Slurm example under real torchrun (2 gloo ranks), with torchrun's own restarts.

One job goes through what a scheduler and the hardware do to it and must end bitwise as an uninterrupted run of
the same layout: a rank killed (SIGKILL) -> torchrun restarts the workers (``--max-restarts 1``), which reconnect
(the per-attempt store prefix, titanlike.fault.init_process_group) and resume from the newest checkpoint; then the
time limit's SIGUSR1 to the batch script -> forwarded through srun and torchrun to the workers, every rank finishes
its step, the step is saved, the job requeued -> the same script again resumes at that step and finishes. ``srun``
and ``scontrol`` are stand-ins (this machine is the allocation); bash, torchrun and the trainer are real. A signal
to one rank only, and PP / FSDP / TP layouts, are in tests/checkpoint/test_checkpoint_dist.py (ranks started as
torchrun starts them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dist_utils import unused_port, worker_env

from titanlike.checkpoint import committed_checkpoints
from titanlike.data import asset_path

REPO = Path(__file__).resolve().parents[2]
FAULT_WORKER = REPO / "tests" / "checkpoint" / "checkpoint_fault_worker.py"
STEPS = 30
CONFIG = "configs/debug_model.toml"  # what the Slurm example passes as --job.config_file (CONFIG_FILE)


def train_args(corpus: Path) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--data.path",
        str(corpus),
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
        "--comm.timeout_seconds",
        "30",
    ]


SRUN = """#!/bin/bash
# srun stand-in: the allocation is this machine; options are dropped, the command runs here
while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done
[[ $1 == hostname ]] && { echo 127.0.0.1; exit 0; }
exec "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: the node list is this machine; a requeue is recorded
case $1 in
    show) echo localhost ;;
    requeue) echo "requeue $2" >> "$REQUEUE_LOG" ;;
esac
"""


def logged(dump: Path) -> dict[int, float]:
    path = dump / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def start_reference(out: Path, args: list[str]) -> subprocess.Popen:
    """The same job uninterrupted: 2 ranks started as torchrun starts them (tests/checkpoint_fault_worker.py), run
    side by side with the job under test."""
    return subprocess.Popen(
        [sys.executable, str(FAULT_WORKER), str(out), "none", "--", "--job.config_file", CONFIG, *args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reference_losses(proc: subprocess.Popen, out: Path) -> dict[int, float]:
    log = proc.communicate(timeout=300)[0]
    job = json.loads((out / "none" / "job.json").read_text())
    assert proc.returncode == 0 and job["exit_codes"] == [0, 0], log[-3000:] + (out / "none" / "rank0.log").read_text()
    losses = logged(out / "none")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _workers(dump: Path) -> dict[tuple[int, int], int]:
    """(restart attempt, rank) -> pid of the torchrun workers training into ``dump``."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if str(dump).encode() not in (d / "cmdline").read_bytes():
                continue
            env = dict(v.split(b"=", 1) for v in (d / "environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env:
            found[(int(env[b"TORCHELASTIC_RESTART_COUNT"]), int(env[b"RANK"]))] = int(d.name)
    return found


class Job:
    """A launched job whose output is collected line by line as it comes."""

    def __init__(self, command: list[str], env: dict):
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, cond, timeout: float = 240.0):
        deadline = time.monotonic() + timeout
        while not (value := cond()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.reader.join(5)
                state = "ended" if self.proc.poll() is not None else "timed out"
                pytest.fail(f"waiting for {what}: the job {state}:\n{self.out[-4000:]}")
            time.sleep(0.02)
        return value

    def in_attempt(self, dump: Path, attempt: int, steps: int) -> dict[tuple[int, int], int]:
        """Wait until torchrun's restart attempt ``attempt`` has trained ``steps`` steps past the checkpoint it
        resumed from; its workers' pids by (attempt, rank)."""

        def progress():
            lines = list(self.lines)
            resumed = [i for i, line in enumerate(lines) if line.startswith("checkpoint: resumed from ")]
            if len(resumed) < attempt:
                return False
            begin = resumed[attempt - 1] if attempt else 0
            first = int(lines[begin].split("(step ")[1].split(")")[0]) if attempt else 0
            trained = [line for line in lines[begin:] if line.startswith("step ")]
            return bool(trained) and int(trained[-1].split()[1]) >= first + steps

        self.wait_for(f"attempt {attempt}, {steps} steps", progress)
        return {k: v for k, v in _workers(dump).items() if k[0] == attempt}

    def finish(self, timeout: float = 240.0) -> str:
        self.proc.wait(timeout)
        self.reader.join(10)
        return self.out


def test_a_job_killed_signalled_and_requeued_ends_as_an_uninterrupted_one(tmp_path):
    corpus = tmp_path / "corpus.txt"  # a part of the shipped corpus: tokenized in a blink at each of the 5 starts
    corpus.write_text(Path(asset_path("corpus", "tinyshakespeare.txt")).read_text()[:100_000])
    args = train_args(corpus)
    reference = start_reference(tmp_path / "reference", args)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    requeues = tmp_path / "requeue.log"
    env = worker_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NNODES="1",
        NPROC_PER_NODE="2",
        MASTER_PORT=str(unused_port()),
        MAX_RESTARTS="1",
        SHUTDOWN_TIMEOUT="120",
        CONFIG_FILE=CONFIG,
        REQUEUE_LOG=str(requeues),
    )
    dump = tmp_path / "job"
    command = ["bash", "scripts/multinode_slurm.sbatch", *args, "--job.dump_folder", str(dump)]
    job = Job(command, env)
    try:
        # attempt 0: rank 1 dies (SIGKILL); torchrun restarts both workers, which resume from the newest checkpoint
        os.kill(job.in_attempt(dump, 0, 7)[(0, 1)], signal.SIGKILL)
        # attempt 1: the time limit is near: Slurm's --signal=B:USR1 goes to the batch script, which forwards it
        job.in_attempt(dump, 1, 4)
        os.kill(job.proc.pid, signal.SIGUSR1)
        out = job.finish()
    except BaseException:
        for proc in (job.proc, reference):
            proc.kill()
        raise
    saved = list(committed_checkpoints(dump / "checkpoint"))
    assert requeues.read_text() == "requeue 4242\n", out[-4000:]
    last = saved[-1]
    assert f"checkpoint: stopped on SIGUSR1 after saving step {last}; exit code 75" in out, out[-4000:]
    assert out.count("exit code 75") == 1, out[-4000:]
    assert "connectFullMesh" not in out and max(logged(dump)) == last < STEPS

    again = Job(command, env)  # the requeued job: the same script, the same command
    out2 = again.finish()
    assert again.proc.returncode == 0, out2[-4000:]
    assert requeues.read_text() == "requeue 4242\n"
    assert f"resumed from {dump / 'checkpoint' / f'step-{last}'} (step {last})" in out2, out2[-4000:]
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # every step logged once: nothing after a save was lost or repeated
    assert logged(dump) == reference_losses(reference, tmp_path / "reference")  # bitwise
    resumed = [line.split("(step ")[1].split(")")[0] for line in (out + out2).splitlines() if "resumed from" in line]
    print(f"resumed at steps {resumed} (saves every 5 steps, and the exit signal's)")
