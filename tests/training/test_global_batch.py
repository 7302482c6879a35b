"""The same run on every layout: the global batch is fixed by the config (default 8 sequences per step, each
data-parallel rank reading its share, refused when it does not split), so ``python train.py`` and ``torchrun
--nproc_per_node=2 train.py`` with the default config log the same step-1 loss; every checkpoint records its global
batch and a resume that changes it is refused (or, with ``checkpoint.accept_global_batch_change``, announced)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import unused_port, worker_env

from titanlike.checkpoint import read_meta
from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.errors import ConfigError
from titanlike.training.trainer import main

REPO = Path(__file__).resolve().parents[2]


def test_the_local_batch_is_the_global_batch_over_the_data_parallel_ranks():
    for world, local in ((1, 8), (2, 4), (4, 2), (8, 1)):
        t = load_config([], world_size=world).training
        assert (t.global_batch_size, t.local_batch_size) == (8, local)
    t = load_config(["--parallelism.tensor_parallel_degree", "2"], world_size=4).training
    assert (t.global_batch_size, t.local_batch_size) == (8, 4)  # dp 2
    with pytest.raises(ConfigError) as e:
        load_config([], world_size=3)
    assert str(e.value) == (
        "training.global_batch_size 8 does not split over the data-parallel degree 3 (local batch = global / dp); "
        "set training.global_batch_size to a multiple of 3, or training.local_batch_size for a batch per rank"
    )
    # accumulation: a local batch below the share
    t = load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "8"], world_size=2).training
    assert (t.global_batch_size, t.local_batch_size) == (8, 2)
    # a config that sets only the per-rank batch keeps torchtitan's meaning: local x dp
    t = load_config(["--training.local_batch_size", "8"], world_size=2).training
    assert (t.global_batch_size, t.local_batch_size) == (-1, 8)
    with pytest.raises(ConfigError, match="both -1"):
        load_config(["--training.global_batch_size", "-1"], world_size=1)


def _step1(log: str, dump: Path) -> tuple[str, float]:
    shown = re.search(r"^step +1  loss +(\S+)", log, re.M)
    assert shown, log[-3000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return shown.group(1), next(r["loss"] for r in rows if r.get("step") == 1 and "loss" in r)


def _train(launcher: list[str], dump: Path, *argv: str) -> str:
    proc = subprocess.run(
        [*launcher, "train.py", *argv, "--training.steps", "1", "--job.dump_folder", str(dump)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("config", [[], ["--job.config_file", "configs/debug_model.toml"]], ids=["defaults", "debug"])
def test_python_and_torchrun_2_log_the_same_step_1_loss(tmp_path, config):
    one = _train([sys.executable], tmp_path / "one", *config, "--validation.enable", "false")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port"]
    two = _train([*torchrun, str(unused_port())], tmp_path / "two", *config, "--validation.enable", "false")
    assert "global batch 8 x" in one and "global batch 8 x" in two, (one[-2000:], two[-2000:])
    (shown1, loss1), (shown2, loss2) = _step1(one, tmp_path / "one"), _step1(two, tmp_path / "two")
    assert shown1 == shown2 and abs(loss1 - loss2) < 1e-5, (shown1, shown2, loss1, loss2)


def test_a_resume_that_changes_the_global_batch_is_refused_or_announced(tmp_path, capsys):
    args = [
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--data.path",
        str(asset_path("corpus", "tinyshakespeare.txt")),
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    ]
    assert main([*args, "--training.steps", "2"]) == 0
    assert read_meta(tmp_path / "checkpoint" / "step-2")["global_batch_size"] == 8
    capsys.readouterr()
    assert main([*args, "--training.steps", "4", "--training.global_batch_size", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: checkpoint '{tmp_path / 'checkpoint' / 'step-2'}' was trained with a global batch of 8 sequences "
        f"per step, this run's is 4 (training.global_batch_size 4, local 4 x 1 data-parallel); resume with "
        f"--training.global_batch_size 8, or set checkpoint.accept_global_batch_change to change it\n"
    ), err
    # torchtitan's meaning on another layout changes it as well: refused the same way
    assert main([*args, "--training.steps", "4", "--training.local_batch_size", "2"]) == 2
    assert "was trained with a global batch of 8" in capsys.readouterr().err
    extra = ["--training.global_batch_size", "4", "--checkpoint.accept_global_batch_change"]
    assert main([*args, "--training.steps", "4", *extra]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: the global batch changes from 8 to 4 sequences per step at step 2" in out, out
    assert read_meta(tmp_path / "checkpoint" / "step-4")["global_batch_size"] == 4
