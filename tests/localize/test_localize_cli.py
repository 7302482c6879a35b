"""``python -m titanlike.localize`` on the trainer's way in (train.py flags): a layout run end to end, bad input
refused in one line with exit 2 before any rank starts; the hooks gone once the localiser is done."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
TINY = (
    "--model.flavor", "tiny", "--model.dim", "64", "--model.max_seq_len", "16", "--training.seq_len", "16",
    "--training.global_batch_size", "8",
)  # fmt: skip


def localize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanlike.localize", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_trainer_layout_no_divergence():
    r = localize("--nproc", "2", *TINY, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("no divergence above 1e-10 in 2 steps ("), r.stdout


def test_bad_config_exit_2():
    r = localize("--nproc", "2", *TINY, "--training.stesp", "3")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: unknown config key 'training.stesp' (did you mean 'training.steps'?)"
    r = localize("--nproc", "4", *TINY, "--parallelism.tensor_parallel_degree", "3")
    # every problem of the layout in the one line: the degrees, then what tp 3 cannot split
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: 4 problems: (1) parallelism: world size 4 is not divisible by tp 3"), r.stderr
    assert "(2) parallelism.tensor_parallel_degree 3 does not divide n_heads 4" in r.stderr
    r = localize("--nproc", "2", "--steps", "0", "--module", "x.py", "--training.steps", "3")
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "error: --steps must be at least 1, got 0; --module takes no train.py flags, got --training.steps 3"
    )


def test_hooks_removed_after_close():
    from titanlike.localize import Reference, Tracer

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    tracer = Tracer([model], Reference(), compare=False)
    tracer.begin_step(1)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert len(tracer.ref.steps[0].forward) == 4  # the root and its 3 children
    assert len(tracer.ref.steps[0].backward) == 4
    tracer.close()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
