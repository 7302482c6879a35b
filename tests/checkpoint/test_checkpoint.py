"""Checkpointing in one process through the real Trainer: bitwise-exact resume (sync and async saves), retention,
seed checkpoints, injected non-finite losses, and kill -9 in the middle of a save (a subprocess)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import kill_at_pause_points

from titanlike.checkpoint import NonFiniteStateError, committed_checkpoints, read_meta, read_model_state_dict
from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
KILL_WORKER = Path(__file__).with_name("checkpoint_kill_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))


def base_args(dump: Path, steps: int = 8, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        str(steps),
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
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def run(dump: Path, steps: int = 8, *extra: str) -> tuple[Trainer, list[float]]:
    trainer = Trainer(load_config(base_args(dump, steps, *extra), world_size=1))
    return trainer, trainer.train()


def assert_same_state(a: Trainer, b: Trainer) -> None:
    """Model weights and optimizer states bitwise equal."""
    sa, sb = a.model_parts[0].state_dict(), b.model_parts[0].state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i, st in oa["state"].items():
        for name, t in st.items():
            assert torch.equal(t, ob["state"][i][name]), (i, name)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps straight, saving every 4 steps (the reference of every resume below)."""
    dump = tmp_path_factory.mktemp("straight")
    trainer, losses = run(dump, 8, "--checkpoint.enable", "--checkpoint.interval", "4")
    return dump, trainer, losses


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_resume_is_bitwise_exact(straight, tmp_path, mode):
    dump_a, a, losses_a = straight
    assert len(losses_a) == 8 and all(math.isfinite(x) for x in losses_a)
    # Saved under the mode tested, then resumed from step-4 in a fresh folder with the same config.
    source = dump_a
    if mode == "async":
        source = tmp_path / "first"
        first, _ = run(source, 8, "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode", mode)
        assert first.checkpointer.last_step == 8
    shutil.copytree(source / "checkpoint" / "step-4", tmp_path / "b" / "checkpoint" / "step-4")
    b, losses_b = run(
        tmp_path / "b", 8, "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode", mode
    )
    assert not a.meta_init and b.meta_init  # the resumed run never initialised weights it would overwrite
    assert losses_b == losses_a[4:]  # bitwise: float equality of every loss
    assert (b.step, b.tokens_seen, b.nonfinite_steps) == (a.step, a.tokens_seen, a.nonfinite_steps)
    assert b.lr_scheduler.state_dict() == a.lr_scheduler.state_dict()
    assert_same_state(a, b)
    meta = read_meta(tmp_path / "b" / "checkpoint" / "step-8")
    assert meta["step"] == 8 and meta["data_position"] == 8 * 4 and meta["tokens_seen"] == 8 * 4 * 32


def test_keep_latest_k_and_leftovers_of_killed_saves(tmp_path):
    folder = tmp_path / "checkpoint"
    leftover = folder / "step-1.tmp-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    not_ours = folder / "notes.txt"
    not_ours.write_text("keep me")
    run(tmp_path, 6, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "step-4", "step-6"]


def test_keep_latest_k_keeps_the_newest_ten_by_default_as_torchtitan(tmp_path):
    """No keep_latest_k set: the newest 10 checkpoints are kept (torchtitan's default), not every one."""
    run(tmp_path, 12, "--checkpoint.enable", "--checkpoint.interval", "1")
    assert sorted(committed_checkpoints(tmp_path / "checkpoint")) == list(range(3, 13))


def test_seed_checkpoint_then_start_from_it_under_another_seed(tmp_path):
    seed_dump = tmp_path / "seed"
    trainer, losses = run(seed_dump, 4, "--checkpoint.create_seed_checkpoint")
    assert losses == [] and trainer.step == 0
    step0 = seed_dump / "checkpoint" / "step-0"
    assert list(committed_checkpoints(seed_dump / "checkpoint")) == [0]
    assert read_meta(step0)["kind"] == "seed"
    seed_weights = read_model_state_dict(step0)
    assert not any(k.startswith("optimizer") for k in seed_weights)
    for k, v in trainer.model_parts[0].state_dict().items():
        assert torch.equal(seed_weights[k], v), k

    # A run with a different training.seed starts from the seed checkpoint's weights, at step 0.
    other = Trainer(
        load_config(
            base_args(
                tmp_path / "other",
                2,
                "--training.seed",
                "7",
                "--data.shuffle",
                "false",
                "--checkpoint.initial_load_path",
                str(step0),
            ),
            world_size=1,
        )
    )
    assert not torch.equal(other.model_parts[0].tok_embeddings.weight, seed_weights["tok_embeddings.weight"])
    assert other.checkpointer.load() == 0
    for k, v in other.model_parts[0].state_dict().items():
        assert torch.equal(seed_weights[k], v), k

    # And trains exactly like a run initialised from the same seed (the seed checkpoint's own; the data order is
    # made independent of training.seed).
    _, ref = run(tmp_path / "ref", 2, "--data.shuffle", "false")
    other.checkpointer = None  # weights already loaded
    assert other.train() == ref


def test_injected_nonfinite_losses_are_skipped_counted_and_never_saved(tmp_path, monkeypatch):
    """NaN losses at steps 3 and 5: both skipped (weights unchanged), counted, and no checkpoint holds a non-finite
    value; a third one at step 6 is the max_nonfinite_steps=3rd skip: the run stops there."""
    trainer = Trainer(
        load_config(
            base_args(
                tmp_path, 8, "--checkpoint.enable", "--checkpoint.interval", "1", "--training.max_nonfinite_steps", "3"
            ),
            world_size=1,
        )
    )
    loss_fn = trainer.loss.loss_fn
    bad_steps = {3, 5, 6}
    weights_before: dict[int, torch.Tensor] = {}

    def poisoned(logits, labels):
        weights_before[trainer.step] = trainer.model_parts[0].output.weight.detach().clone()
        out = loss_fn(logits, labels)
        return out * float("nan") if trainer.step in bad_steps else out

    trainer.loss.loss_fn = poisoned
    with pytest.raises(
        RuntimeError,
        match=r"stopping at step 6: 3 non-finite steps skipped, "
        r"training.max_nonfinite_steps=3",
    ):
        trainer.train()
    assert trainer.step == 6 and trainer.nonfinite_steps == 3
    folder = tmp_path / "checkpoint"
    assert list(committed_checkpoints(folder)) == [1, 2, 3, 4, 5]  # step 6 stopped the run before its save
    assert torch.equal(read_model_state_dict(folder / "step-3")["output.weight"], weights_before[3])  # skipped
    assert read_meta(folder / "step-5")["nonfinite_steps"] == 2
    for step, path in committed_checkpoints(folder).items():
        sd = read_model_state_dict(path)
        assert all(torch.isfinite(t).all() for t in sd.values()), step

    # Resuming from step-5 restores the counter: one more non-finite step is tolerated, the next one is not.
    resumed = Trainer(
        load_config(
            base_args(
                tmp_path, 8, "--checkpoint.enable", "--checkpoint.interval", "1", "--training.max_nonfinite_steps", "3"
            ),
            world_size=1,
        )
    )
    resumed.checkpointer.load()
    assert (resumed.step, resumed.nonfinite_steps) == (5, 2)


def test_a_non_finite_state_is_never_saved(tmp_path):
    """The last line of defence: a NaN weight refuses the save (no folder is written); finite values whose sum
    overflows float32 are saved."""
    trainer = Trainer(load_config(base_args(tmp_path, 2, "--checkpoint.enable"), world_size=1))
    weight = trainer.model_parts[0].layers["1"].feed_forward.w2.weight
    with torch.no_grad():
        weight.fill_(3e38)  # finite, sums to inf
    trainer.checkpointer.save(1)
    assert list(committed_checkpoints(tmp_path / "checkpoint")) == [1]
    with torch.no_grad():
        weight[0, 0] = float("nan")
    with pytest.raises(
        NonFiniteStateError,
        match=r"not saving step 2: the state holds non-finite values: 'model.layers.1.feed_forward.w2.weight' "
        r"\(rank 0\); the previous checkpoint, if any, stays the newest",
    ):
        trainer.checkpointer.save(2)
    trainer.close()  # lets go of the run lock
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


KILL_POINTS = ["write_data", "finish"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """For every pause point, a run (8 steps, a save every 2) SIGKILLed inside its save of step 4 (side by side)."""
    return kill_at_pause_points(
        tmp_path_factory,
        KILL_WORKER,
        REPO,
        KILL_POINTS,
        lambda dump: base_args(dump, 8, "--checkpoint.enable", "--checkpoint.interval", "2"),
    )


@pytest.mark.parametrize("pause", KILL_POINTS)
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(straight, killed, pause):
    """Killed after the data files of step 4 were written (``write_data``) or even after DCP's .metadata
    (``finish``, before the commit): step-4 does not exist, step-2 resumes, and the run ends as the straight one."""
    dump = killed[pause]
    folder = dump / "checkpoint"
    assert list(committed_checkpoints(folder)) == [2]
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith("step-4.tmp-")]
    assert len(leftovers) == 1
    assert (folder / leftovers[0] / ".metadata").exists() == (pause == "finish")
    b, losses = run(dump, 8, "--checkpoint.enable", "--checkpoint.interval", "2")
    assert losses == straight[2][2:]
    assert_same_state(b, straight[1])
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6", "step-8"]  # leftover gone
    assert read_meta(folder / "step-4")["step"] == 4


def test_kill_9_during_a_seed_write_commits_nothing_and_a_rerun_cleans_up(tmp_path_factory):
    """A seed-checkpoint run SIGKILLed after DCP's .metadata but before the commit leaves no step-0 (only its
    temporary folder, and its run lock); run again into the same folder, it takes the lock of the dead process over,
    removes the leftover and commits step-0."""
    dump = kill_at_pause_points(
        tmp_path_factory,
        KILL_WORKER,
        REPO,
        ["finish"],
        lambda d: base_args(d, 4, "--checkpoint.create_seed_checkpoint"),
    )["finish"]
    folder = dump / "checkpoint"
    leftovers = sorted(p.name for p in folder.iterdir())
    assert committed_checkpoints(folder) == {} and len(leftovers) == 2 and leftovers[0] == ".titanlike.lock"
    assert leftovers[1].startswith("step-0.tmp-") and (folder / leftovers[1] / ".metadata").exists()
    run(dump, 4, "--checkpoint.create_seed_checkpoint")
    assert sorted(p.name for p in folder.iterdir()) == ["step-0"] and read_meta(folder / "step-0")["kind"] == "seed"


def test_moe_resume_is_bitwise_exact_with_the_expert_biases(tmp_path):
    """Qwen3-MoE (tiny: the bias update and the aux loss on): the expert biases are persistent buffers of the state
    dict, so a run resumed from step 2 continues bitwise like the straight one: losses, weights, biases, optimizer."""
    moe = ("--model.name", "qwen3_moe", "--checkpoint.enable", "--checkpoint.interval", "2")
    a, losses_a = run(tmp_path / "a", 4, *moe)
    biases = {k: v for k, v in a.model_parts[0].state_dict().items() if k.endswith("expert_bias")}
    assert biases and all(v.abs().max() > 0 for v in biases.values())  # the update acted
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-2", tmp_path / "b" / "checkpoint" / "step-2")
    b, losses_b = run(tmp_path / "b", 4, *moe)
    assert losses_b == losses_a[2:]
    assert_same_state(a, b)


def test_transformers_model_resume_is_bitwise_exact(tmp_path):
    """model.name = "hf" (Qwen2 from a config.json folder: q/k/v biases, tied embeddings): the DCP checkpoint of the
    library's own modules resumes bitwise (losses, weights, optimizer), the tie still one parameter."""
    from hf_models import hf_folder

    hf = ("--model.name", "hf", "--model.hf_config", hf_folder("hf_qwen2_tied", vocab_size=2048))
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2")
    a, losses_a = run(tmp_path / "a", 4, *hf, *ckpt)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-2", tmp_path / "b" / "checkpoint" / "step-2")
    b, losses_b = run(tmp_path / "b", 4, *hf, *ckpt)
    assert losses_b == losses_a[2:]
    assert_same_state(a, b)
    model = b.model_parts[0]
    assert model.lm_head.weight is model.embed_tokens.weight
