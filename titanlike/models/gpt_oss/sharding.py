"""How gpt-oss splits over tensor parallelism: Qwen3-MoE's layout without the q/k norms (attention heads column-
split, ``wo`` row-split, biases with their Linear's entry), the attention sinks split with their heads
(``HeadParams``: rank ``r`` holds the sinks of its own heads), and the MoE block ``TokenLocal`` (the experts over
ep, which borrows the tp ranks; rule ``moe_tp``)."""

from titanlike.sharding import Colwise, Head, HeadParams, Norm, Region, Rowwise, TokenLocal, VocabEmbedding

__all__ = ["SHARDING", "sharding_of"]

SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": Region(),
    "layers.*.attention.wq": Colwise(),
    "layers.*.attention.wk": Colwise(),
    "layers.*.attention.wv": Colwise(),
    "layers.*.attention.sinks": HeadParams(),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.moe": TokenLocal(),
    "norm": Norm(),
    "output": Head(),
}


def sharding_of(args) -> dict:
    """The entries of a model of ``args`` (without sinks: no sinks entry)."""
    if getattr(args, "attention_sinks", True):
        return SHARDING
    return {k: v for k, v in SHARDING.items() if not k.endswith(".sinks")}
