"""GPT-2 (learned positions, LayerNorm with bias, fused c_attn, GELU MLP, tied embeddings) and its model spec."""

from titanlike.models.gpt2.model import FLAVORS, GPT2, MLP, Block, CausalSelfAttention, GPT2Args, param_init
from titanlike.models.gpt2.sharding import SHARDING
from titanlike.models.spec import ModelSpec, register

__all__ = ["GPT2", "FLAVORS", "Block", "CausalSelfAttention", "GPT2Args", "MLP", "SPEC", "param_init"]


SPEC = register(
    ModelSpec(
        name="gpt2",
        model_cls=GPT2,
        args_cls=GPT2Args,
        flavors=FLAVORS,
        sharding=SHARDING,
        context_parallel=True,
        norm_kind="layer",
        mlp_kind="gelu",
        hf_adapter="titanlike.models.gpt2.hf",
    )
)
