"""Bad checkpoint input: train.py exits with code 2 and one line naming the problem, and changes nothing on disk."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.hf import save_hf
from titanlike.models import FLAVORS
from titanlike.training.trainer import Trainer, main

CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))


def args(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "16",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.enable_jsonl",
        "false",
        "--metrics.log_freq",
        "100",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A dump folder whose checkpoint folder holds step-2 and step-4 of the tiny model."""
    dump = tmp_path_factory.mktemp("saved")
    Trainer(
        load_config(
            args(dump, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.checksum"), world_size=1
        )
    ).train()
    return dump


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def fails_with(capsys, root: Path, argv: list[str], *expected: str) -> str:
    """main(argv) must exit 2 with one 'error: ...' line holding every ``expected`` text, touching nothing."""
    before = snapshot(root)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for text in expected:
        assert text in err, err
    assert snapshot(root) == before
    return err


@pytest.fixture
def dump(saved, tmp_path) -> Path:
    shutil.copytree(saved, tmp_path / "dump")
    return tmp_path / "dump"


def test_checkpoint_of_another_model_shape(dump, capsys):
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--model.dim", "64"),
        "step-4' is for a different model",
        "tok_embeddings.weight' has shape (2048, 32) there, (2048, 64) here",
    )
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--model.n_layers", "3"),
        "is for a different model: it has no 'layers.2.attention_norm.weight'",
    )
    # another model altogether: named (checkpoint.json), not a shape mismatch
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--model.name", "qwen3"),
        "step-4' holds a llama3 model (its checkpoint.json) and this run builds qwen3 (model.name); set model.name "
        "= llama3",
    )


def test_truncated_checkpoint(dump, capsys):
    data = dump / "checkpoint" / "step-4" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable"),
        "step-4' is corrupted: __0_0.distcp is truncated (1000 of",
        "move it out of",
    )


def test_missing_data_file(dump, capsys):
    (dump / "checkpoint" / "step-4" / "__0_0.distcp").unlink()
    fails_with(capsys, dump, args(dump, "--checkpoint.enable"), "step-4' is corrupted: __0_0.distcp is missing")


def test_corrupted_metadata_and_checkpoint_json(dump, capsys):
    meta = dump / "checkpoint" / "step-4" / "checkpoint.json"
    meta.write_text("{not json")
    fails_with(capsys, dump, args(dump, "--checkpoint.enable"), "checkpoint.json is corrupted")
    (dump / "checkpoint" / "step-4" / ".metadata").write_bytes(b"\x80\x04garbage")
    fails_with(capsys, dump, args(dump, "--checkpoint.enable"), "step-4' is corrupted: its .metadata cannot be read")


def test_corrupted_entry_found_while_loading(dump, capsys):
    """Damage that only shows when the bytes are read (the pickled LR scheduler state zeroed) is one line, exit 2,
    reported as corruption of its file: the entry that cannot be parsed, or the checksum it fails."""
    from torch.distributed.checkpoint import FileSystemReader

    step4 = dump / "checkpoint" / "step-4"
    md = FileSystemReader(str(step4)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "train.lr_scheduler.base_lrs")
    raw = bytearray((step4 / info.relative_path).read_bytes())
    raw[info.offset : info.offset + info.length] = b"\x00" * info.length
    (step4 / info.relative_path).write_bytes(bytes(raw))
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--checkpoint.checksum", "false"),
        f"step-4' is corrupted: {info.relative_path} cannot be parsed at the entry 'train.lr_scheduler.base_lrs' "
        f"(bytes {info.offset}-{info.offset + info.length}: UnpicklingError: ",
    )
    # With checksums (the default) the entry's checksum names the damage before its bytes are parsed.
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable"),
        f"step-4' is corrupted: {info.relative_path} does not match its checksum at the entry "
        f"'train.lr_scheduler.base_lrs'",
    )


def test_load_step_that_does_not_exist_or_is_not_the_newest(dump, capsys):
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--checkpoint.load_step", "3"),
        "checkpoint.load_step 3: there is no committed checkpoint step-3",
        "(steps there: 2, 4)",
    )
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.enable", "--checkpoint.load_step", "2"),
        "also holds later checkpoints (4)",
    )
    fails_with(capsys, dump, args(dump, "--checkpoint.load_step", "4"), "needs checkpoint.enable = true")


def test_unwritable_checkpoint_folder(tmp_path, capsys):
    (tmp_path / "checkpoint").write_text("a file where the folder should be")
    fails_with(
        capsys, tmp_path, args(tmp_path, "--checkpoint.enable"), "checkpoint.folder: '", "is a file, not a folder"
    )
    fails_with(capsys, tmp_path, args(tmp_path, "--checkpoint.create_seed_checkpoint"), "is a file, not a folder")
    (tmp_path / "blocker").write_text("a file where a parent folder should be")
    fails_with(
        capsys,
        tmp_path,
        args(tmp_path, "--checkpoint.enable", "--checkpoint.folder", str(tmp_path / "blocker" / "ckpt")),
        "checkpoint.folder: cannot write checkpoints to",
        "(Not a directory)",
    )


def test_seed_checkpoint_never_overwrites(dump, capsys):
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.create_seed_checkpoint"),
        "already holds checkpoints (step-2, step-4); not overwriting them",
    )


def test_seed_checkpoint_refuses_the_keys_it_would_ignore(tmp_path, capsys):
    """A seed checkpoint is the weights initialised from training.seed: initial weights to load, a step to resume
    or an export at the end would be silently ignored; every one is named in the one line."""
    fails_with(
        capsys,
        tmp_path,
        args(
            tmp_path,
            "--checkpoint.create_seed_checkpoint",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(tmp_path),
            "--checkpoint.load_step",
            "2",
            "--checkpoint.export_safetensors",
        ),
        "checkpoint.initial_load_path, checkpoint.load_step, checkpoint.export_safetensors would be ignored; "
        "remove them",
    )


def test_bad_initial_load_path(dump, tmp_path, capsys):
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", str(tmp_path / "nothing")),
        "checkpoint.initial_load_path:",
        "does not exist",
    )
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", CORPUS),
        "is not a .safetensors file or a folder holding model.safetensors",
    )
    other = FLAVORS["tiny"].replace(vocab_size=2048, dim=64)
    hf_dir = tmp_path / "hf"
    from titanlike.models import Transformer

    save_hf(Transformer(other).state_dict(), other, hf_dir)
    # config.json sets the architecture; a model option that disagrees with it is refused
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", str(hf_dir / "model.safetensors"), "--model.dim", "32"),
        "sets the architecture from its config.json, which disagrees with model.dim 32 (config.json has 64)",
    )
    (hf_dir / "config.json").unlink()  # without config.json the shapes still decide
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", str(hf_dir)),
        "model.embed_tokens.weight has shape (2048, 64), the model needs (2048, 32)",
    )
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    fails_with(
        capsys, dump, args(dump, "--checkpoint.initial_load_path", str(hf_dir)), "is not a readable safetensors file"
    )


def test_a_checkpoint_as_initial_load_path_sets_the_architecture(dump, tmp_path, capsys):
    """A titanlike checkpoint as checkpoint.initial_load_path: its checkpoint.json is the architecture (as a Hugging
    Face folder's config.json is), whatever the flavor; a model.* option that disagrees, or another model.name, is
    refused in one line."""
    step = str(dump / "checkpoint" / "step-4")
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", step, "--model.dim", "64"),
        "sets the architecture from its checkpoint.json, which disagrees with model.dim 64 (checkpoint.json has 32)",
    )
    fails_with(
        capsys,
        dump,
        args(dump, "--checkpoint.initial_load_path", step, "--model.name", "qwen3"),
        "is a llama3 model (its checkpoint.json), model.name is qwen3; set model.name = llama3",
    )
    argv = args(tmp_path / "other", "--checkpoint.initial_load_path", step, "--training.steps", "1")
    argv[argv.index("tiny")] = "debugmodel"  # another flavor: not used, and the start-up line says so
    trainer = Trainer(load_config(argv, world_size=1))
    out = capsys.readouterr().out
    assert trainer.model_args == Trainer(load_config(args(tmp_path / "x"), world_size=1)).model_args
    assert f"model: architecture from {step} checkpoint.json (model.flavor debugmodel not used): dim 32" in out
    assert "model llama3: " in out and "llama3/" not in out


def test_export_needs_checkpointing(tmp_path, capsys):
    fails_with(
        capsys,
        tmp_path,
        args(tmp_path, "--checkpoint.export_safetensors"),
        "checkpoint.export_safetensors exports the final checkpoint: set checkpoint.enable",
    )


def test_the_intact_checkpoint_still_resumes(dump):
    """After all that, the same folder resumes (the control: the failures above came from the damage alone)."""
    trainer = Trainer(load_config(args(dump, "--checkpoint.enable", "--training.steps", "5"), world_size=1))
    assert trainer.checkpointer.load() == 4
    assert json.loads((dump / "checkpoint" / "step-4" / "checkpoint.json").read_text())["step"] == 4
    assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())
