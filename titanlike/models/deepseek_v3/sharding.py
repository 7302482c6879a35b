"""How DeepSeek-V3 splits over tensor parallelism (torchtitan's and Megatron-Core's MLA plan): the query and
key/value up-projections (``wq`` / ``wq_b``, ``wkv_b``) split by heads, the latent down-projections (``wq_a``,
``wkv_a``) and their norms (``q_norm``, ``kv_norm``) replicated inside the attention region, their gradients summed
over tp (each rank's heads use the whole latent: ``Latent``), the shared RoPE key handed to the per-head part as this
rank's local tensor (``k_rope``), the output projection row-wise, sequence parallelism between blocks; the dense
layers' SwiGLU column / row-wise; the MoE blocks ``TokenLocal`` (as ``qwen3_moe``: the experts split over ep, which
borrows the tp ranks under SP). The MTP depths: their norms and ``eh_proj`` on the residual stream (replicated, run
on this rank's sequence part under SP), their blocks as the main blocks.
"""

from titanlike.sharding import Colwise, Head, Latent, Norm, Region, Rowwise, TokenLocal, VocabEmbedding

__all__ = ["SHARDING", "sharding_for"]


def _block(prefix: str, *, q_lora: bool = True, plain_q: bool = True, dense: bool = True, moe: bool = True) -> dict:
    out = {
        f"{prefix}.attention_norm": Norm(),
        f"{prefix}.attention": Region(),
        f"{prefix}.attention.wq": Colwise(),
        f"{prefix}.attention.wq_a": Latent(),
        f"{prefix}.attention.q_norm": Latent(),
        f"{prefix}.attention.wq_b": Colwise(),
        f"{prefix}.attention.wkv_a": Latent(),
        f"{prefix}.attention.kv_norm": Latent(),
        f"{prefix}.attention.wkv_b": Colwise(),
        f"{prefix}.attention.k_rope": Latent(local_output=True),
        f"{prefix}.attention.wo": Rowwise(),
        f"{prefix}.ffn_norm": Norm(),
        f"{prefix}.feed_forward": Region(),
        f"{prefix}.feed_forward.w1": Colwise(),
        f"{prefix}.feed_forward.w3": Colwise(),
        f"{prefix}.feed_forward.w2": Rowwise(),
        f"{prefix}.moe": TokenLocal(),
    }
    drop = [] if q_lora else ["wq_a", "q_norm", "wq_b"]
    drop += [] if plain_q else ["wq"]
    out = {k: v for k, v in out.items() if not any(k == f"{prefix}.attention.{d}" for d in drop)}
    if not dense:
        out = {k: v for k, v in out.items() if ".feed_forward" not in k}
    if not moe:
        out.pop(f"{prefix}.moe")
    return out


SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    **_block("layers.*"),
    "norm": Norm(),
    "output": Head(),
    "mtp.*.embed": VocabEmbedding(),  # tied to tok_embeddings: sharded alike
    "mtp.*.enorm": Norm(),
    "mtp.*.hnorm": Norm(),
    "mtp.*.eh_proj": Norm(),  # a replicated Linear on the residual stream: the same style as a norm
    **_block("mtp.*.block"),
    "mtp.*.norm": Norm(),
}


def sharding_for(args) -> dict:
    """The entries of the modules a model of ``args`` has (``SHARDING`` matches every variant: q low-rank or
    plain, dense and MoE layers, MTP depths)."""
    q = dict(q_lora=bool(args.q_lora_rank), plain_q=not args.q_lora_rank)
    out = {
        "tok_embeddings": VocabEmbedding(),
        **_block("layers.*", **q, dense=args.n_dense_layers > 0, moe=args.n_moe_layers > 0 and args.num_experts > 0),
        "norm": Norm(),
        "output": Head(),
    }
    if args.mtp_layers:
        moe = args.is_moe_layer(args.n_layers)
        out.update({k: v for k, v in SHARDING.items() if k.startswith("mtp.") and ".block" not in k})
        out.update(_block("mtp.*.block", **q, dense=not moe, moe=moe))
    return out
