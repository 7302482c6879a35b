"""scripts/replay_step.py: a clean step replays bitwise; a step whose saved weight got a flipped bit (in memory,
after the step computed it and before the save: the checkpoint's checksums match what was written) is named, the
tensor and the element count; bad input is one line, exit 2. One process, in this process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from dist_utils import tiny_run_args

import titanlike.training.trainer as trainer_module
from titanlike.config import load_config
from titanlike.data import asset_path

REPO = Path(__file__).resolve().parents[2]
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
OPTS = [
    "--model.flavor",
    "tiny",
    *tiny_run_args(CORPUS),
    "--training.device",
    "cpu",
    "--lr_scheduler.warmup_steps",
    "2",
]
FLIPPED = "layers.0.attention.wq.weight"


def replay_main():
    spec = importlib.util.spec_from_file_location("replay_step", REPO / "scripts" / "replay_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def train(dump: Path, flip_after: int | None = None, monkeypatch=None) -> None:
    if flip_after is not None:
        inner, calls = trainer_module.train_step, []

        def flipping(model_parts, *args, **kwargs):
            out = inner(model_parts, *args, **kwargs)
            calls.append(1)
            if len(calls) == flip_after:
                with torch.no_grad():
                    w = model_parts[0].get_parameter(FLIPPED).view(-1).view(torch.int32)
                    w[7] ^= 1 << 13  # a mantissa bit: the weight changes by about 1e-4 of itself
            return out

        monkeypatch.setattr(trainer_module, "train_step", flipping)
    argv = [*OPTS, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "1"]
    t = trainer_module.Trainer(load_config([*argv, "--job.dump_folder", str(dump)], world_size=1))
    try:
        t.train()
    finally:
        t.close()
    if flip_after is not None:
        monkeypatch.setattr(trainer_module, "train_step", inner)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    dump = tmp_path_factory.mktemp("clean")
    train(dump)
    return dump


def test_a_clean_step_replays_bitwise(clean, capsys):
    assert replay_main()(["--checkpoint", str(clean / "checkpoint"), "--step", "3", "--", *OPTS]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("step 3 replayed from step 2 on 1 process(es): bitwise equal ("), out
    print(out)


def test_a_flipped_bit_in_the_saved_state_is_named(tmp_path, monkeypatch, capsys):
    train(tmp_path, flip_after=3, monkeypatch=monkeypatch)
    main = replay_main()
    assert main(["--checkpoint", str(tmp_path / "checkpoint"), "--step", "3", "--", *OPTS]) == 1
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert "step 3 replayed from step 2 on 1 process(es): 1 of " in out, out
    assert f"tensors differ from the run's checkpoint: 'model.{FLIPPED}' (1 element(s), largest difference" in out
    run, replay = out.split("loss of step 3: run ")[1].split(". Only")[0].split(", replay ")
    assert run == replay  # the bit flipped after the step's loss
    print(out)
    # the next step, replayed from the corrupt checkpoint, reproduces it (the corruption is in its input)
    assert main(["--checkpoint", str(tmp_path / "checkpoint"), "--step", "4", "--", *OPTS]) == 0


def test_bad_input_is_one_line(clean, capsys):
    main = replay_main()
    assert main(["--checkpoint", str(clean / "checkpoint"), "--step", "9", "--", *OPTS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step 9:" in err[0] and "holds no committed checkpoint" in err[0], err
    assert main(["--checkpoint", str(clean / "checkpoint"), "--step", "1", "--", *OPTS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no committed checkpoint before step 1" in err[0], err
