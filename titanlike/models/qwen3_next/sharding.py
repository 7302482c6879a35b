"""How Qwen3-Next splits over tensor parallelism.

Gated attention: Qwen3's plan (q | gate per head, so the column split of ``wq`` keeps each head's two halves
together; per-head q/k norms as ``HeadNorm``). Gated DeltaNet: its fused projections are grouped by key head as
transformers stores them (group ``i``: ``q_i | k_i | v_i | z_i`` and ``b_i | a_i``), so a plain column split gives
every rank whole groups (tp must divide the key heads: the spec's shape rules); the conv's channels (grouped the same
way), ``A_log`` and ``dt_bias`` go with their heads (``HeadParams``), the per-head output norm is a ``HeadNorm``,
``out_proj`` row-wise. The MoE block is ``TokenLocal`` (Qwen3-MoE's: each tp rank routes its own part of the
sequence, the experts over ``ep``; the router, shared expert and its gate data-parallel over tp).
"""

from titanlike.sharding import Colwise, Head, HeadNorm, HeadParams, Norm, Region, Rowwise, TokenLocal, VocabEmbedding

__all__ = ["SHARDING", "sharding_of"]

SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": Region(),
    "layers.*.attention.wq": Colwise(),
    "layers.*.attention.wk": Colwise(),
    "layers.*.attention.wv": Colwise(),
    "layers.*.attention.q_norm": HeadNorm(),
    "layers.*.attention.k_norm": HeadNorm(),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.linear_attn": Region(),
    "layers.*.linear_attn.in_proj_qkvz": Colwise(),
    "layers.*.linear_attn.in_proj_ba": Colwise(),
    "layers.*.linear_attn.conv": HeadParams(heads_dim=2),
    "layers.*.linear_attn.decay": HeadParams(heads_dim=2),
    "layers.*.linear_attn.norm": HeadNorm(),
    "layers.*.linear_attn.out_proj": Rowwise(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.moe": TokenLocal(),
    "norm": Norm(),
    "output": Head(),
}
_DENSE = {
    "layers.*.feed_forward": Region(),
    "layers.*.feed_forward.w1": Colwise(),
    "layers.*.feed_forward.w3": Colwise(),
    "layers.*.feed_forward.w2": Rowwise(),
}


def sharding_of(args) -> dict:
    """The entries of a model of ``args``: the MoE block's (``SHARDING``), or a dense SwiGLU's without experts."""
    if args.num_experts:
        return SHARDING
    dense = {k: v for k, v in SHARDING.items() if k != "layers.*.moe"}
    return {**dense, **_DENSE}
