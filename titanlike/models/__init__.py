"""Model definitions. Plain ``torch.nn``: nothing in here imports ``torch.distributed``."""

from titanlike.models.llama import FLAVORS, ModelArgs, Transformer, TransformerBlock, pad_vocab

MODELS = {"llama3": FLAVORS}

__all__ = ["FLAVORS", "MODELS", "ModelArgs", "Transformer", "TransformerBlock", "pad_vocab"]
