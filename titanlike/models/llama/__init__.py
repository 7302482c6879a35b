"""The Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) and its model spec."""

from titanlike.models.llama.model import (
    FLAVORS,
    Attention,
    CausalAttention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rope,
    pad_vocab,
    param_init,
    rope_tables,
)

__all__ = [
    "FLAVORS",
    "Attention",
    "CausalAttention",
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


def _build(args, layer_ids=None, has_input=True, has_output=True):
    return Transformer(args, layer_ids=layer_ids, has_embedding=has_input, has_head=has_output)


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


from titanlike.models.spec import ModelSpec, register  # noqa: E402

SPEC = register(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        args_cls=ModelArgs,
        flavors=FLAVORS,
        build=_build,
        input_modules=("tok_embeddings",),
        output_modules=("norm", "output"),
        block_container="layers",
        tied=(("tok_embeddings.weight", "output.weight"),),
        param_init=param_init,
        shape_violations=_shape_violations,
        hf_adapter="titanlike.models.llama.hf",
    )
)
