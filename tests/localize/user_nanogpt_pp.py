"""A user's pipeline for ``python -m titanlike.localize --module``: the README's NanoGPT (examples/nanogpt_parallel.py,
tied embeddings) split over ``MESH = {"pp": 2}`` with ``pipeline_module`` (the pipeline gate's user split, 1F1B,
4 microbatches): the stage holding ``wte`` and the one holding ``lm_head`` each keep a copy of the tied weight, whose
gradients ``finalize_grads`` sums."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "parallel"), str(HERE.parents[1] / "examples")]

MESH = {"pp": 2}
SPLIT = [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]


def build():
    from nanogpt import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(vocab=128, block_size=16)


def parallelize(model, mesh):
    from titanlike.loss import cross_entropy_loss
    from titanlike.parallel.pipeline import pipeline_module

    return pipeline_module(
        model,
        mesh["pp"],
        SPLIT,
        loss_fn=lambda out, labels: cross_entropy_loss(out, labels, reduction="sum"),
        n_microbatches=4,
        schedule="1F1B",
    )


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (8, 17), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, :3] = -100
    return tokens[:, :-1], labels
