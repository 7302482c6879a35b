"""A model that draws random numbers every step (dropout on the embeddings), for the fault tests: a resume is
bitwise only if every RNG state is saved and restored exactly as the next step would have used it."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F

import titanlike.training.trainer as trainer_module
from titanlike.models import Transformer, get_spec

DROPOUT = 0.1


class DropoutTransformer(Transformer):
    """The plain model with dropout on the token embeddings (a forward hook: same parameters, same names)."""

    def __init__(self, args):
        super().__init__(args)
        self.tok_embeddings.register_forward_hook(lambda m, inputs, out: F.dropout(out, DROPOUT, m.training))


def _dropout_get_spec(name: str):
    """The registered spec, with the Llama one building DropoutTransformer (same FQNs, same roles)."""
    spec = get_spec(name)
    if name != "llama3":
        return spec
    return dataclasses.replace(spec, model_cls=DropoutTransformer)


def use_dropout_model(monkeypatch=None) -> None:
    """Make the Trainer build DropoutTransformer (with pytest's monkeypatch, undone after the test): the trainer asks
    the model spec for its model (titanlike/models/spec.py), so the spec it gets builds the dropout variant."""
    if monkeypatch is not None:
        monkeypatch.setattr(trainer_module, "get_spec", _dropout_get_spec)
    else:
        trainer_module.get_spec = _dropout_get_spec
