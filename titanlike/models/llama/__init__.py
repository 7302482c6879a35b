"""The Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) and its model spec."""

from titanlike.models.llama.model import (
    FLAVORS,
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rope,
    pad_vocab,
    rope_tables,
)

__all__ = ["FLAVORS", "Attention", "FeedForward", "ModelArgs", "RMSNorm", "Transformer", "TransformerBlock",
           "apply_rope", "pad_vocab", "rope_tables"]
