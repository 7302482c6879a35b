"""The Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) and its model spec."""

from titanlike.models.layers import FeedForward, RMSNorm, apply_rope, rope_tables
from titanlike.models.llama.model import (
    FLAVORS,
    Attention,
    ModelArgs,
    Transformer,
    TransformerBlock,
    pad_vocab,
    param_init,
)

__all__ = [
    "FLAVORS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "pad_vocab",
    "param_init",
    "rope_tables",
]


def _shape_violations(args) -> list[str]:
    out = []
    if args.head_dim % 2:
        out.append(f"model: head_dim {args.head_dim} (dim / n_heads) must be even for RoPE")
    if args.rope_scaling == "llama3":
        if args.rope_scaling_factor < 1:
            out.append(f"model.rope_scaling_factor {args.rope_scaling_factor} must be >= 1")
        if not args.rope_low_freq_factor < args.rope_high_freq_factor:
            out.append(
                f"model.rope_low_freq_factor {args.rope_low_freq_factor} must be below "
                f"model.rope_high_freq_factor {args.rope_high_freq_factor}"
            )
        if args.rope_original_max_seq_len < 1:
            out.append("model.rope_original_max_seq_len must be >= 1")
    return out


from titanlike.models.llama.sharding import SHARDING  # noqa: E402
from titanlike.models.spec import ModelSpec, register  # noqa: E402

SPEC = register(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        args_cls=ModelArgs,
        flavors=FLAVORS,
        sharding=SHARDING,
        context_parallel=True,
        te_norm=RMSNorm,
        shape_violations=_shape_violations,
        hf_adapter="titanlike.models.llama.hf",
    )
)
