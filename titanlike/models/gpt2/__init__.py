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
from titanlike.models.spec import ModelSpec, register

__all__ = ["GPT2", "FLAVORS", "Block", "CausalSelfAttention", "GPT2Args", "MLP", "SPEC", "param_init", "sdpa_causal"]


def _build(args, layer_ids=None, has_input=True, has_output=True):
    return GPT2(args, layer_ids=layer_ids, has_input=has_input, has_output=has_output)


def _shard_dims(name: str, tp: bool, fsdp: bool) -> tuple[int | None, int]:
    """(tp dim, FSDP dim) of a parameter under this model's plan (titanlike/parallel/gpt2.py)."""
    if name.endswith("c_attn.weight"):  # chunk-sharded rows; FSDP takes dim 1 then (titanlike.parallel.fused)
        return 0, 1 if tp else 0
    if name.endswith("c_attn.bias"):  # replicated over tp once FSDP shards it
        return (None if fsdp else 0), 0
    if name.endswith("c_proj.weight"):
        return 1, 0
    if name.endswith(("c_fc.weight", "c_fc.bias", "tok_embeddings.weight", "output.weight")):
        return 0, 0
    return None, 0  # LayerNorms, c_proj biases, position table: replicated


SPEC = register(
    ModelSpec(
        name="gpt2",
        model_cls=GPT2,
        args_cls=GPT2Args,
        flavors=FLAVORS,
        build=_build,
        input_modules=("tok_embeddings", "pos_embeddings"),
        output_modules=("norm", "output"),
        block_container="layers",
        tied=(("tok_embeddings.weight", "output.weight"),),
        param_init=param_init,
        norm_kind="layer",
        mlp_kind="gelu",
        hf_adapter="titanlike.models.gpt2.hf",
        shard_dims=_shard_dims,
    )
)
