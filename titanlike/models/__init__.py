"""Model definitions, one folder per model, each registering a :class:`~titanlike.models.spec.ModelSpec`.

Plain ``torch.nn``: the models import nothing from ``torch.distributed`` and nothing of titanlike but ``init``
(parameter distributions). ``registry`` imports the built-in models and answers ``get_spec`` / ``spec_for``.
"""

from titanlike.models.llama import FLAVORS, ModelArgs, Transformer, TransformerBlock, pad_vocab
from titanlike.models.registry import DEFAULT_MODEL, block_container_of, get_spec, registered, spec_for
from titanlike.models.spec import ModelSpec, UnknownModelError, register

__all__ = [
    "DEFAULT_MODEL",
    "FLAVORS",
    "ModelArgs",
    "ModelSpec",
    "Transformer",
    "TransformerBlock",
    "UnknownModelError",
    "block_container_of",
    "get_spec",
    "pad_vocab",
    "register",
    "registered",
    "spec_for",
]
