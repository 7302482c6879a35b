"""A model that draws random numbers every step (dropout on the embeddings), for the fault tests: a resume is
bitwise only if every RNG state is saved and restored exactly as the next step would have used it."""

from __future__ import annotations

import torch.nn.functional as F

import titanlike.training.trainer as trainer_module
from titanlike.models import Transformer

DROPOUT = 0.1


class DropoutTransformer(Transformer):
    """The plain model with dropout on the token embeddings (a forward hook: same parameters, same names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tok_embeddings.register_forward_hook(lambda m, inputs, out: F.dropout(out, DROPOUT, m.training))


def use_dropout_model(monkeypatch=None) -> None:
    """Make the Trainer build DropoutTransformer (with pytest's monkeypatch, undone after the test)."""
    if monkeypatch is not None:
        monkeypatch.setattr(trainer_module, "Transformer", DropoutTransformer)
    else:
        trainer_module.Transformer = DropoutTransformer
