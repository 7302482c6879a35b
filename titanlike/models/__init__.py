"""Model definitions, one folder per model, each registering a :class:`~titanlike.models.spec.ModelSpec`.

Plain ``torch.nn``: the models import nothing from ``torch.distributed`` and nothing else of titanlike (their
tensor-parallel plans live in ``titanlike.parallel``: ``tensor_parallel.model_tp_plan``).
"""

from titanlike.models.llama import FLAVORS, ModelArgs, Transformer, TransformerBlock, pad_vocab
from titanlike.models.spec import DEFAULT_MODEL, ModelSpec, UnknownModelError, get_spec, register, registered, spec_for

__all__ = [
    "DEFAULT_MODEL",
    "FLAVORS",
    "ModelArgs",
    "ModelSpec",
    "Transformer",
    "TransformerBlock",
    "UnknownModelError",
    "get_spec",
    "pad_vocab",
    "register",
    "registered",
    "spec_for",
]
