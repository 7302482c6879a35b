"""GPT-2 (learned positions, LayerNorm with bias, fused c_attn, GELU MLP, tied embeddings) and its model spec."""

from titanlike.models.gpt2.model import (
    FLAVORS,
    GPT2,
    MLP,
    Block,
    CausalSelfAttention,
    GPT2Args,
    param_init,
    sdpa_causal,
)
from titanlike.models.gpt2.sharding import SHARDING
from titanlike.models.spec import ModelSpec, register

__all__ = ["GPT2", "FLAVORS", "Block", "CausalSelfAttention", "GPT2Args", "MLP", "SPEC", "param_init", "sdpa_causal"]


def _build(args, layer_ids=None, has_input=True, has_output=True):
    return GPT2(args, layer_ids=layer_ids, has_input=has_input, has_output=has_output)


SPEC = register(
    ModelSpec(
        name="gpt2",
        model_cls=GPT2,
        args_cls=GPT2Args,
        flavors=FLAVORS,
        sharding=SHARDING,
        build=_build,
        input_modules=("tok_embeddings", "pos_embeddings"),
        output_modules=("norm", "output"),
        block_container="layers",
        tied=(("tok_embeddings.weight", "output.weight"),),
        param_init=param_init,
        norm_kind="layer",
        mlp_kind="gelu",
        config_keys=("dim", "n_layers", "n_heads", "ffn_hidden_dim", "max_seq_len", "norm_eps"),
        hf_adapter="titanlike.models.gpt2.hf",
        hf_model_type="gpt2",
    )
)
