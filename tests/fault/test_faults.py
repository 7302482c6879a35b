"""Fault injection in one process, through the real Trainer, on a model that draws random numbers every step
(dropout, tests/fault_model.py): bitwise resume including the RNG, kill -9 at each phase of a save, a step folder
without its commit marker, a flipped byte, a full disk, weights made non-finite by an update. The 2-rank faults (a
rank stopped or dead inside a save or a step) are in tests/test_checkpoint_dist.py (one shared launch)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import kill_at_pause_points
from fault_model import use_dropout_model

from titanlike.checkpoint import (
    CheckpointSaveError,
    committed_checkpoints,
    read_dcp_metadata,
    read_model_state_dict,
)
from titanlike.checkpoint.files import quiet_dcp
from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.training.trainer import NonFiniteError, Trainer, main

REPO = Path(__file__).resolve().parents[2]
KILL_WORKER = Path(__file__).with_name("fault_kill_worker.py")
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
        "--checkpoint.checksum",
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


def flip_a_weight_byte(step_dir: Path) -> str:
    md = read_dcp_metadata(step_dir)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.layers.0.attention.wq.weight")
    f = step_dir / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + info.length - 7] ^= 0x10  # inside the tensor's data: still a valid file of the same size
    f.write_bytes(bytes(raw))
    return info.relative_path


def test_a_flipped_byte_is_caught_by_the_checksum(straight, tmp_path, capsys):
    """One bit flipped inside a weight of step-4 (checkpoint.checksum on): with on_corrupt = "stop" (the default)
    the run refuses with one line naming the file and changes nothing; with "previous" step-4 is set aside and the
    run resumes from step-2, ending exactly as the straight run."""
    folder = copy_checkpoints(straight, tmp_path)
    name = flip_a_weight_byte(folder / "step-4")
    capsys.readouterr()
    assert main(base_args(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"step-4' is corrupted: {name} does not match its checksum" in err, err
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
    with pytest.raises(NonFiniteError, match=r"stopping at step 2: 2 non-finite steps skipped"):
        trainer.train()


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
