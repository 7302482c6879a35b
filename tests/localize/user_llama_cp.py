"""A ``--module`` file asking for context parallelism (``MESH = {"cp": 2}``): titanlike's tiny Llama built as a user
builds it (the model class, no config), ``apply_cp`` over the cp mesh and FSDP over the same ranks to sum the
parameters' gradients; the localiser cuts every batch tensor into each rank's load-balanced chunks. ``PLANT``
(set by user_llama_cp_rope_local.py): the gate's ``cp_rope_local`` on the parallel side."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "parallel")]

MESH = {"cp": 2}
PLANT = None  # a key of tests/parallel/gate.py MUTATIONS
_PLANTED = contextlib.ExitStack()  # open until the process ends: the reference has run, the layout's steps follow


def build():
    from titanlike.models.llama.model import FLAVORS, Transformer

    model = Transformer(FLAVORS["tiny"].replace(vocab_size=128, max_seq_len=16))
    model.init_weights(seed=0)
    return model


def parallelize(model, mesh):
    from titanlike.parallel import apply_fsdp
    from titanlike.parallel.context_parallel import apply_cp

    if PLANT is not None:
        import gate

        _PLANTED.enter_context(gate.MUTATIONS[PLANT]())
    apply_cp(model, mesh["cp"])
    return apply_fsdp(model, mesh["cp"])


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
