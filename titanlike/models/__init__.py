"""Model definitions, one folder per model, each registering a :class:`~titanlike.models.spec.ModelSpec`.

Plain ``torch.nn``: the models import nothing from ``torch.distributed`` (a model's ``parallelize.py`` does, and is
imported only when its plan is asked for).
"""

from titanlike.models.llama import FLAVORS, ModelArgs, Transformer, TransformerBlock, pad_vocab
from titanlike.models.spec import ModelSpec, UnknownModelError, get_spec, register, registered, spec_for

__all__ = ["FLAVORS", "ModelArgs", "ModelSpec", "Transformer", "TransformerBlock", "UnknownModelError", "get_spec",
           "pad_vocab", "register", "registered", "spec_for"]
