"""Ctrl-C on a real 2-rank torchrun job: SIGINT to the job's whole process group, as a terminal sends it. Every rank
finishes its step, the job saves it and exits (the workers with 75), rank 0 says so in one line and no rank prints a
traceback; the same command then resumes at that step, nothing recomputed. Without checkpointing, Ctrl-C is one line
too (nothing saved), not a traceback per rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist_utils import unused_port, worker_env

from titanlike.checkpoint import committed_checkpoints
from titanlike.data import asset_path

REPO = Path(__file__).resolve().parents[2]
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))


def args(dump: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "32",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def torchrun(*train_args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(unused_port())]
    return subprocess.Popen(
        [*cmd, "train.py", *train_args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def logged_steps(dump: Path) -> list[int]:
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


def ctrl_c_after(proc: subprocess.Popen, dump: Path, step: int) -> str:
    deadline = time.monotonic() + 240
    while max(logged_steps(dump), default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=120)[0]


def test_ctrl_c_saves_the_step_in_one_line_and_the_rerun_resumes_there(tmp_path):
    dump = tmp_path / "run"
    train = args(dump, 100_000, "--checkpoint.enable", "--checkpoint.interval", "100000")
    log = ctrl_c_after(torchrun(*train), dump, 3)
    saved = list(committed_checkpoints(dump / "checkpoint"))
    assert len(saved) == 1, log[-3000:]
    n = saved[0]
    ours = [ln for ln in log.splitlines() if ln.startswith(("checkpoint:", "error:"))]
    assert len(ours) == 1, log[-3000:]  # one line
    assert re.fullmatch(
        re.escape(
            f"checkpoint: stopped on SIGINT (Ctrl-C) after saving step {n}; exit code 75: the same command resumes "
            f"at step {n} (nothing is recomputed): saved step {n} to {dump / 'checkpoint' / f'step-{n}'} ("
        )
        + r"[\d.]+ MiB\) in [\d.]+s",
        ours[0],
    ), ours[0]
    assert "KeyboardInterrupt" not in log and "train.py" not in log.split("Traceback")[-1], log[-3000:]
    assert max(logged_steps(dump)) == n
    rerun = torchrun(*args(dump, n + 2, "--checkpoint.enable", "--checkpoint.interval", "100000"))
    out = rerun.communicate(timeout=240)[0]
    assert rerun.returncode == 0, out[-3000:]
    assert logged_steps(dump) == list(range(1, n + 3)), out[-3000:]  # steps 1..n once, then n+1, n+2
    assert "resum" in out and f"step {n}" in out, out[-3000:]


def test_ctrl_c_without_checkpointing_is_one_line(tmp_path):
    dump = tmp_path / "run"
    log = ctrl_c_after(torchrun(*args(dump, 100_000)), dump, 2)
    lines = [ln for ln in log.splitlines() if "interrupted (Ctrl-C)" in ln]
    assert len(lines) == 1 and "nothing saved" in lines[0], log[-3000:]
    assert "KeyboardInterrupt" not in log, log[-3000:]


def test_a_second_ctrl_c_before_the_step_ends_exits_at_once():
    """The first SIGINT is recorded (the step goes on), a second one past the duplicate window ends the process at
    once with 128 + 2 and one line; the run lock's release runs first."""
    code = (
        "import os, signal, time\n"
        "import titanlike.training.exit_signals as es\n"
        "es.DUPLICATE_WINDOW_S = 0.0\n"
        "s = es.ExitSignals(['SIGINT'], on_exit=lambda: print('released', flush=True))\n"
        "s.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('first recorded', s.received == signal.SIGINT, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
        "print('not reached', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stdout.splitlines() == ["first recorded True", "released"], proc.stdout
    assert proc.stderr.splitlines() == [
        "error: SIGINT again before the step finished: exiting at once without saving; the previous checkpoint is "
        "intact"
    ], proc.stderr


def test_exit_signals_take_commas_and_semicolons():
    from titanlike.config import load_config

    for value in ("SIGTERM,SIGINT", "SIGTERM;SIGINT", "SIGTERM, SIGINT"):
        assert load_config(["--checkpoint.exit_signals", value], world_size=1).checkpoint.exit_signals == [
            "SIGTERM",
            "SIGINT",
        ]
    assert load_config([], world_size=1).checkpoint.exit_signals == ["SIGTERM", "SIGUSR1", "SIGINT"]


def test_ctrl_c_during_the_start_up_is_one_line(monkeypatch, capsys):
    import titanlike.training.trainer as trainer_module

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "Trainer", interrupted)
    assert trainer_module.main(["--model.flavor", "tiny"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "interrupted (Ctrl-C) during the start-up: nothing trained\n"
