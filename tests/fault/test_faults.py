"""Fault injection in one process, through the real Trainer, on a model that draws random numbers every step
(dropout, tests/fault_model.py): bitwise resume including the RNG, kill -9 at each phase of a save, a step folder
without its commit marker, a changed float, a full disk, weights made non-finite by an update. The 2-rank faults (a
rank stopped or dead inside a save or a step) are in tests/test_checkpoint_dist.py (one shared launch)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import before_step, during_the_save_of, kill_at_pause_points, poke_tensor_value
from fault_model import use_dropout_model

from titanlike.checkpoint import (
    CheckpointSaveError,
    committed_checkpoints,
    read_model_state_dict,
)
from titanlike.checkpoint.files import quiet_dcp
from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.training.trainer import NonFiniteError, Trainer, main

REPO = Path(__file__).resolve().parents[2]
KILL_WORKER = Path(__file__).with_name("fault_kill_worker.py")
CLUSTER_WORKER = Path(__file__).with_name("cluster_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
STEPS = 6


def base_args(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "32",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "100",
        "--lr_scheduler.warmup_steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def run(dump: Path, *extra: str) -> tuple[Trainer, list[float]]:
    trainer = Trainer(load_config(base_args(dump, *extra), world_size=1))
    return trainer, trainer.train()


def saved_rng(step_dir: Path) -> torch.Tensor:
    state = {"rng.rank0.cpu": torch.empty_like(torch.get_rng_state())}
    quiet_dcp(dcp.load, state, checkpoint_id=str(step_dir), no_dist=True)
    return state["rng.rank0.cpu"]


def assert_same_run(a: Trainer, b: Trainer) -> None:
    """Weights, AdamW states, counters and the RNG bitwise equal."""
    sa, sb = a.model_parts[0].state_dict(), b.model_parts[0].state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    for i, st in oa["state"].items():
        for name, t in st.items():
            assert torch.equal(t, ob["state"][i][name]), (i, name)
    assert (a.step, a.tokens_seen, a.nonfinite_steps) == (b.step, b.tokens_seen, b.nonfinite_steps)


@pytest.fixture(autouse=True)
def dropout_model(monkeypatch):
    use_dropout_model(monkeypatch)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps straight with dropout, saving every 2: the reference of every resume below."""
    mp = pytest.MonkeyPatch()
    use_dropout_model(mp)
    dump = tmp_path_factory.mktemp("straight")
    trainer, losses = run(dump)
    rng_after = torch.get_rng_state()
    mp.undo()
    return dump, trainer, losses, rng_after


def copy_checkpoints(straight, dest: Path, steps=(2, 4)) -> Path:
    folder = dest / "checkpoint"
    for s in steps:
        shutil.copytree(straight[0] / "checkpoint" / f"step-{s}", folder / f"step-{s}")
    return folder


def test_resume_is_bitwise_including_the_rng(straight, tmp_path):
    """2 steps + a resume for 4 more == 6 straight, bitwise: losses, weights, AdamW, and the RNG states saved and
    left behind; the model draws dropout masks every step, so a single RNG draw off would change every loss."""
    _, a, losses_a, rng_a = straight
    copy_checkpoints(straight, tmp_path, steps=(2,))
    b, losses_b = run(tmp_path)
    assert losses_b == losses_a[2:]
    assert_same_run(a, b)
    assert torch.equal(torch.get_rng_state(), rng_a)
    for s in (4, 6):
        assert torch.equal(
            saved_rng(tmp_path / "checkpoint" / f"step-{s}"), saved_rng(straight[0] / "checkpoint" / f"step-{s}")
        ), s


def test_resume_test_catches_one_rng_draw_off(straight, tmp_path, monkeypatch):
    """The mutation of the bug this guards against: the data loader's iter() draws one number from the global RNG
    after the restore. The resumed losses then differ."""
    from titanlike.data.loader import TokenDataLoader

    original = TokenDataLoader.__iter__

    def drawing_iter(self):
        torch.empty((), dtype=torch.int64).random_()
        return original(self)

    monkeypatch.setattr(TokenDataLoader, "__iter__", drawing_iter)
    copy_checkpoints(straight, tmp_path, steps=(2,))
    _, losses_b = run(tmp_path)
    assert losses_b != straight[2][2:]


def test_a_step_folder_without_its_commit_marker_is_set_aside(straight, tmp_path, capsys):
    """step-4 without .metadata (a copy cut short, a hand-made folder): never "newest"; set aside with one line, the
    run resumes from step-2 and saves step-4 again without a conflict. Temporary folders of dead saves are removed
    at the start, but only those holding nothing but a save's files."""
    folder = copy_checkpoints(straight, tmp_path)
    (folder / "step-4" / ".metadata").unlink()
    dead = folder / "step-6.tmp-deadbeef"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"partial")
    foreign = folder / "step-8.tmp-cafe"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint file")
    b, losses = run(tmp_path)
    out = capsys.readouterr().out
    assert "step-4 has no .metadata (its save was never committed): set aside as step-4.incomplete-" in out, out
    assert "removed 1 temporary folder(s) of interrupted saves: step-6.tmp-deadbeef" in out, out
    assert "not removing step-8.tmp-cafe" in out, out
    assert losses == straight[2][2:]
    assert_same_run(straight[1], b)
    names = sorted(p.name for p in folder.iterdir())
    assert names[:3] == ["step-2", "step-4", "step-4.incomplete-" + b.checkpointer.plan.run_id]
    assert names[3:] == ["step-6", "step-8.tmp-cafe"]


def test_one_changed_float_is_refused_by_default(straight, tmp_path, capsys):
    """One float inside a weight's data of step-4 set to 1000.0 (the file stays valid, its size unchanged), default
    settings (checksums on): with on_corrupt = "stop" (the default) the run refuses with one line naming the file
    and the entry, and changes nothing; with "previous" step-4 is set aside and the run resumes from step-2, ending
    exactly as the straight run."""
    folder = copy_checkpoints(straight, tmp_path)
    name = poke_tensor_value(folder / "step-4", "model.layers.0.attention.wq.weight", 1000.0, index=3)
    capsys.readouterr()
    assert main(base_args(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert (
        f"step-4' is corrupted: {name} does not match its checksum at the entry "
        f"'model.layers.0.attention.wq.weight'" in err
    ), err
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]

    b, losses = run(tmp_path, "--checkpoint.on_corrupt", "previous")
    out = capsys.readouterr().out
    assert "does not match its checksum" in out and "set aside as step-4.corrupt-" in out, out
    assert losses == straight[2][2:]
    assert_same_run(straight[1], b)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_fails_the_save_cleanly(straight, tmp_path, monkeypatch, mode):
    """ENOSPC in the middle of writing step-4's data: one line naming the folder and the free space, the partial
    folder removed, step-2 intact; the same command then resumes from step-2 and ends as the straight run."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    create_stream = FileSystem.create_stream

    class FullDisk:
        def __init__(self, stream):
            self.stream, self.written = stream, 0

        def write(self, data):
            self.written += len(memoryview(data).cast("B"))
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    import contextlib

    @contextlib.contextmanager
    def full_disk_stream(self, path, mode_):
        with create_stream(self, path, mode_) as stream:
            yield FullDisk(stream) if ".tmp-" in str(path) and "step-4." in str(path) else stream

    monkeypatch.setattr(FileSystem, "create_stream", full_disk_stream)
    trainer = Trainer(load_config(base_args(tmp_path, "--checkpoint.async_mode", mode), world_size=1))
    with pytest.raises(CheckpointSaveError) as info:
        trainer.train()
    msg = str(info.value)
    folder = tmp_path / "checkpoint"
    assert "\n" not in msg and f"the checkpoint save of step 4 into '{folder}' failed" in msg, msg
    assert "[Errno 28] No space left on device" in msg and " free there; removed its partial folder step-4.tmp-" in msg
    assert msg.endswith("step-2 is intact"), msg
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    b, losses = run(tmp_path, "--checkpoint.async_mode", mode)
    assert losses == straight[2][2:]
    assert_same_run(straight[1], b)


def test_weights_made_non_finite_by_an_update_stop_the_run(tmp_path, capsys):
    """optimizer.eps = 0: AdamW divides 0 by 0 for embedding rows no token used, with a finite loss and gradient
    norm. Caught at that very step, before any save, with one line naming the parameter."""
    capsys.readouterr()
    assert main(base_args(tmp_path, "--optimizer.eps", "0", "--checkpoint.interval", "1")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: stopping at step 1: the optimizer update made parameter 'tok_embeddings.weight' "
        "non-finite although the loss"
    ), err
    assert "\n" not in err and "optimizer.eps = 0" in err
    assert committed_checkpoints(tmp_path / "checkpoint") == {}


def test_the_nonfinite_counter_stops_at_the_nth_skip(tmp_path):
    trainer = Trainer(load_config(base_args(tmp_path, "--training.max_nonfinite_steps", "2"), world_size=1))
    loss_fn = trainer.loss.loss_fn
    trainer.loss.loss_fn = lambda logits, labels: loss_fn(logits, labels) * float("nan")
    with warnings.catch_warnings():
        # torch's "lr_scheduler.step() before optimizer.step()": the intended order when an update is skipped
        warnings.filterwarnings("error", message="Detected call of `lr_scheduler")
        with pytest.raises(NonFiniteError, match=r"stopping at step 2: 2 non-finite steps skipped"):
            trainer.train()
    assert trainer.lr_scheduler.last_epoch == 2  # the schedule followed the step number through both skips


KILL_POINTS = ["before_rename", "after_rename", "mid_purge"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """For every phase, a run SIGKILLed inside its save of step 4 (keep_latest_k 1; the three side by side)."""
    return kill_at_pause_points(
        tmp_path_factory,
        KILL_WORKER,
        REPO,
        KILL_POINTS,
        lambda dump: base_args(dump, "--checkpoint.keep_latest_k", "1"),
    )


@pytest.mark.parametrize("pause", KILL_POINTS)
def test_kill_9_at_each_phase_of_a_save(straight, killed, pause, capsys):
    """Before the rename the previous checkpoint resumes; after it, the new one; mid-purge, the new one, and the
    half-deleted old one is removed. Every time the run ends exactly as the straight run (RNG included)."""
    dump = killed[pause]
    folder = dump / "checkpoint"
    expected = {"before_rename": [2], "after_rename": [2, 4], "mid_purge": [4]}[pause]
    assert list(committed_checkpoints(folder)) == expected
    b, losses = run(dump, "--checkpoint.keep_latest_k", "1")
    out = capsys.readouterr().out
    if pause != "after_rename":
        assert "removed 1 temporary folder(s) of interrupted saves" in out, out
    assert losses == straight[2][expected[-1] :]
    assert_same_run(straight[1], b)
    assert sorted(p.name for p in folder.iterdir()) == ["step-6"]
    assert torch.equal(
        read_model_state_dict(folder / "step-6")["output.weight"],
        read_model_state_dict(straight[0] / "checkpoint" / "step-6")["output.weight"],
    )


def test_every_process_group_gets_the_timeout(tmp_path):
    """torch gives a new gloo group (DeviceMesh's, new_group's) a 30-minute timeout; bound_process_groups sets
    comm.timeout_seconds on every group of the job, the default one included."""
    import datetime

    import torch.distributed as dist

    from titanlike.fault import bound_process_groups, group_timeout_seconds

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(tmp_path / "store"), 1),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=77),
    )
    try:
        group = dist.new_group(backend="gloo")
        assert (group_timeout_seconds(dist.group.WORLD), group_timeout_seconds(group)) == (77, 1800)
        assert bound_process_groups(datetime.timedelta(seconds=5)) == 2
        assert (group_timeout_seconds(dist.group.WORLD), group_timeout_seconds(group)) == (5, 5)
    finally:
        dist.destroy_process_group()


def test_a_comm_failure_is_told_apart_from_a_bug():
    from torch.distributed.checkpoint.api import CheckpointException

    from titanlike.fault import is_comm_failure

    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")
    assert is_comm_failure(gloo)
    assert is_comm_failure(CheckpointException("save", {1: (gloo, None)}))
    assert not is_comm_failure(CheckpointException("save", {0: (OSError(28, "No space left on device"), None)}))
    assert not is_comm_failure(ValueError("shapes do not match"))


def test_the_new_keys_are_validated(tmp_path, capsys):
    assert main(base_args(tmp_path, "--checkpoint.on_corrupt", "prev")) == 2
    assert (
        "checkpoint.on_corrupt: 'prev' is not one of 'stop', 'previous' (did you mean 'previous'?)"
        in capsys.readouterr().err
    )
    assert main(base_args(tmp_path, "--checkpoint.checksum", "maybe")) == 2
    assert "checkpoint.checksum: expected true or false" in capsys.readouterr().err
    assert main(base_args(tmp_path, "--training.max_nonfinite_steps", "0")) == 2
    assert "training.max_nonfinite_steps: 0 is below the minimum 1" in capsys.readouterr().err
    assert not (tmp_path / "checkpoint").exists()


# ---------------------------------------------------------------------------------------------------- exit signals
@pytest.mark.parametrize("sig,mode", [("SIGTERM", "disabled"), ("SIGUSR1", "async")])
def test_an_exit_signal_saves_the_step_and_the_same_command_resumes_it(straight, tmp_path, monkeypatch, sig, mode):
    """The signal arrives while step 3 trains (saves are every 2 steps): the step is finished and saved
    synchronously (also with async saves), the run raises Preempted (main: exit code 75); a copy of the signal during
    that save (a scheduler signals every process, torchrun forwards its own) is the same notice. The same command
    then resumes at step 3, nothing recomputed, and ends bitwise as the straight run (losses, weights, AdamW, RNG)."""
    from titanlike.training.exit_signals import EXIT_PREEMPTED, Preempted

    signum = getattr(signal, sig)
    before_step(3, lambda: os.kill(os.getpid(), signum), monkeypatch.setattr)
    during_the_save_of(3, lambda: os.kill(os.getpid(), signum), monkeypatch.setattr)
    args = ("--checkpoint.async_mode", mode)
    if mode == "disabled":
        with pytest.raises(Preempted) as info:
            run(tmp_path, *args)
        assert (info.value.step, info.value.signal_name) == (3, sig)
        assert info.value.losses == straight[2][:3]
    else:
        assert main(base_args(tmp_path, *args)) == EXIT_PREEMPTED
    assert list(committed_checkpoints(tmp_path / "checkpoint")) == [2, 3]
    assert signal.getsignal(signum) is signal.SIG_DFL  # the handlers are put back
    monkeypatch.undo()
    use_dropout_model(monkeypatch)
    b, losses = run(tmp_path, *args)
    assert b.checkpointer.plan.step == 3 and losses == straight[2][3:]
    assert_same_run(straight[1], b)
    assert torch.equal(torch.get_rng_state(), straight[3])


def test_a_second_signal_during_that_save_exits_at_once(straight, tmp_path):
    """SIGTERM during step 3, then SIGTERM again once the save of step 3 is writing (the duplicate window set to 0):
    the process exits at once with 128 + 15 and one line; step-2 stays the newest committed checkpoint (the
    interrupted save is a temporary folder), the run lock is released, and the same command resumes from step-2 and
    ends bitwise as the straight run."""
    import subprocess

    from dist_utils import worker_env

    proc = subprocess.run(
        [sys.executable, str(CLUSTER_WORKER), "second_signal:3", *base_args(tmp_path)],
        cwd=REPO,
        env=worker_env(OMP_NUM_THREADS=str(torch.get_num_threads())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [
        "error: SIGTERM again during the checkpoint save on an exit signal: exiting at once; the previous checkpoint "
        "is intact (the interrupted save is removed at the next start)"
    ], proc.stderr[-3000:]
    folder = tmp_path / "checkpoint"
    assert list(committed_checkpoints(folder)) == [2]
    assert [p.name for p in folder.iterdir() if p.name.startswith("step-3.tmp-")], list(folder.iterdir())
    assert not (tmp_path / ".titanlike.lock").exists() and not (folder / ".titanlike.lock").exists()
    b, losses = run(tmp_path)
    assert losses == straight[2][2:]
    assert_same_run(straight[1], b)


# ---------------------------------------------------------------------------------------------------- bad state
def test_a_non_finite_loaded_state_is_refused_naming_the_tensor(straight, tmp_path, capsys):
    """A NaN in a norm weight of step-4, and an infinity in an AdamW moment, in a checkpoint without checksums (an
    older one): each is refused before the first step in one line naming the checkpoint and the first bad tensor,
    with a note that the entries were not verified; nothing on disk changes. With on_corrupt = "previous" step-4 is
    set aside and the run resumes from step-2, ending exactly as the straight run."""
    folder = copy_checkpoints(straight, tmp_path)
    step4 = folder / "step-4"
    (step4 / "checksums.json").unlink()
    clean = (step4 / "__0_0.distcp").read_bytes()
    for fqn, value in [
        ("model.layers.0.attention_norm.weight", float("nan")),
        ("optimizer.state.layers.1.feed_forward.w1.weight.exp_avg_sq", float("inf")),
    ]:
        (step4 / "__0_0.distcp").write_bytes(clean)
        poke_tensor_value(step4, fqn, value, index=1)
        capsys.readouterr()
        assert main(base_args(tmp_path)) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith(f"error: checkpoint '{step4}' holds non-finite values: '{fqn}' (rank 0); move it out")
        assert "\n" not in err, err
        assert f"'{step4}' has no checksums" in captured.out and "loaded unverified" in captured.out
        assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]
    b, losses = run(tmp_path, "--checkpoint.on_corrupt", "previous")
    out = capsys.readouterr().out
    assert "holds non-finite values" in out and "set aside as step-4.corrupt-" in out, out
    assert losses == straight[2][2:]
    assert_same_run(straight[1], b)


def test_a_non_finite_state_is_not_saved_one_line(tmp_path, monkeypatch, capsys):
    """An AdamW moment made infinite before the save of step 2 (the weights finite, so the update check passes):
    the save refuses in one line naming the tensor (no traceback), exit code 1, and nothing is committed."""
    from titanlike.checkpoint import CheckpointManager

    save = CheckpointManager.save

    def poisoned_save(self, step, *args, **kwargs):
        state = next(iter(self.optimizer.state.values()))
        state["exp_avg"].view(-1)[0] = float("inf")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", poisoned_save)
    capsys.readouterr()
    assert main(base_args(tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: not saving step 2: the state holds non-finite values: 'optimizer.state.") and (
        ".exp_avg' (rank 0); the previous checkpoint, if any, stays the newest" in err
    ), err
    assert "\n" not in err
    assert committed_checkpoints(tmp_path / "checkpoint") == {}


def test_bytes_that_do_not_parse_are_corruption_not_unsafe_content(straight, tmp_path, capsys):
    """Random bytes over the head of step-4's data file (where its byte entries are): by default the checksum names
    the entry; without checksums the entry that cannot be parsed is reported as corruption of that file; never as
    the security refusal of content that parses and is not plain data."""
    folder = copy_checkpoints(straight, tmp_path, steps=(4,))
    data = folder / "step-4" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[:64] = bytes(torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8))
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(base_args(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert "step-4' is corrupted: __0_0.distcp does not match its checksum at the entry '" in err, err
    (folder / "step-4" / "checksums.json").unlink()
    assert main(base_args(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert "step-4' is corrupted: __0_0.distcp cannot be parsed at the entry '" in err and "(bytes 0-" in err, err
    assert "not plain data" not in err and "\n" not in err


def test_a_checkpoint_without_checksums_loads_with_a_note(straight, tmp_path, capsys):
    folder = copy_checkpoints(straight, tmp_path, steps=(4,))
    (folder / "step-4" / "checksums.json").unlink()
    capsys.readouterr()
    b, losses = run(tmp_path)
    assert "has no checksums (written with checkpoint.checksum = false" in capsys.readouterr().out
    assert losses == straight[2][4:]
    assert_same_run(straight[1], b)


# ---------------------------------------------------------------------------------------------------- run lock
def _lock_file(folder: Path, host: str, pid: int, age_s: float = 0.0, process_start: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / ".titanlike.lock"
    holder = {"host": host, "pid": pid, "process_start": process_start, "started": "2025-01-01T00:00:00+00:00"}
    lock.write_text(json.dumps({**holder, "token": "t"}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_second_job_into_a_running_jobs_folders_exits_2(tmp_path, capsys):
    """A job runs (paused before step 3); a second launch into its dump folder, and one into another dump folder
    but its checkpoint folder, each exit 2 with one line naming the holder, before any process group; the first
    job then finishes with its own metrics (each step once) and checkpoints."""
    import socket
    import subprocess

    from dist_utils import worker_env

    dump = tmp_path / "job"
    go = tmp_path / "go"
    a = subprocess.Popen(
        [sys.executable, str(CLUSTER_WORKER), f"pause:3:{go}", *base_args(dump, "--metrics.log_freq", "1")],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{go}.paused").exists():
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()[0][-3000:]
            time.sleep(0.05)
        for args in (base_args(dump), base_args(tmp_path / "other", "--checkpoint.folder", str(dump / "checkpoint"))):
            capsys.readouterr()
            assert main(args) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("error: job: '") and "\n" not in err, err
            assert f"is in use by another job (pid {a.pid} on {socket.gethostname()}, started " in err, err
        assert not (tmp_path / "other").exists()
    finally:
        go.touch()
        out = a.communicate(timeout=120)[0]
    assert a.returncode == 0, out[-3000:]
    rows = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
    assert sorted(p.name for p in dump.iterdir()) == ["checkpoint", "metrics.jsonl"]
    assert list(committed_checkpoints(dump / "checkpoint")) == [2, 4, 6]


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    """A lock whose process is gone (this host), or whose heartbeat is older than job.stale_lock_seconds (another
    host), is taken over with a note; another host's lock with a fresh heartbeat is refused; the lock goes with
    the run."""
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    cases = [
        (socket.gethostname(), gone.pid, 0.0, f"pid {gone.pid} on this host is gone"),
        ("node-17", 4242, 1000.0, "pid 4242 on node-17: no heartbeat for 100"),  # 1000 s, or 1001 s by now
    ]
    for host, pid, age, why in cases:
        _lock_file(tmp_path, host, pid, age)
        capsys.readouterr()
        trainer = Trainer(load_config(base_args(tmp_path, "--job.stale_lock_seconds", "100"), world_size=1))
        out = capsys.readouterr().out
        assert f"job: took over the stale lock of {tmp_path} ({why}" in out, out
        assert host != "node-17" or " s, job.stale_lock_seconds = 100)" in out, out
        lock = json.loads((tmp_path / ".titanlike.lock").read_text())
        assert (lock["pid"], lock["host"]) == (os.getpid(), socket.gethostname())
        trainer.close()
        assert not (tmp_path / ".titanlike.lock").exists()
    _lock_file(tmp_path, "node-17", 4242, 10.0)
    assert main(base_args(tmp_path, "--job.stale_lock_seconds", "100")) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"in use by another job \(pid 4242 on node-17, started 2025-01-01T00:00:00\+00:00; its heartbeat \d+ s ago\)",
        err,
    ), err


def test_the_lock_has_a_heartbeat(tmp_path):
    from titanlike.training.run_lock import LOCK_NAME, RunLock

    lock = RunLock([tmp_path / "a"], stale_after_s=1.0).acquire()
    path = tmp_path / "a" / LOCK_NAME
    os.utime(path, (time.time() - 100, time.time() - 100))
    time.sleep(1.2)
    assert time.time() - path.stat().st_mtime < 1.0
    lock.release()
    assert not (tmp_path / "a").exists()  # the lock made the folder, and it stayed empty
