"""Qwen3-MoE in plain ``torch.nn``: Qwen3's attention (QK-norm GQA, rotate-half RoPE; imported from
``titanlike.models.qwen3``, not copied) and, in every layer, the mixture-of-experts block of
``titanlike.models.moe`` instead of the dense SwiGLU. Shapes as published (Qwen's config.json files and transformers'
``Qwen3MoeConfig``): top-8 of 128 experts, ``moe_intermediate_size`` per expert, ``norm_topk_prob`` (the top-k
weights renormalised), no shared experts.

The same block carries the DeepSeek-V3 routing options (sigmoid scores with the aux-loss-free bias balancing,
shared experts, group-limited top-k, a route scale, the first ``n_dense_layers`` layers dense): the ``deepseek``
flavor has DeepSeek-V3's MoE shapes on Qwen3's attention (grouped-query, not multi-head latent attention), for
planning.

Module names: ``tok_embeddings``, ``layers.N.{attention_norm, attention.{wq, wk, wv, wo, q_norm, k_norm}, ffn_norm,
moe.{router.gate, experts.{w1, w2, w3}, shared_experts.{w1, w2, w3}}}`` (a dense layer: ``feed_forward.{w1, w2,
w3}``), ``norm``, ``output``; the buffer ``layers.N.moe.expert_bias`` is persistent (checkpointed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns
from titanlike.models.decoder import Decoder
from titanlike.models.layers import RMSNorm, RopeTables
from titanlike.models.moe import MoEArgs, MoEDecoderBlock, init_moe_buffers
from titanlike.models.qwen3 import Attention, Qwen3Args


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    # Qwen3's fields (dim, heads, head_dim, ...) and: the routed experts ...
    moe_hidden_dim: int = 768  # per routed expert (Hugging Face: moe_intermediate_size)
    num_experts: int = 128
    top_k: int = 8  # experts per token (num_experts_per_tok)
    route_norm: bool = True  # the top-k weights renormalised to sum to 1 (norm_topk_prob)
    score_func: str = "softmax"  # softmax (Qwen3) | sigmoid (DeepSeek-V3)
    route_scale: float = 1.0
    num_groups: int = 1  # group-limited routing (DeepSeek-V3: 8 groups, each token in its 4 best)
    topk_groups: int = 1
    num_shared_experts: int = 0  # experts every token uses (DeepSeek-V3: 1)
    shared_hidden_dim: int | None = None  # per shared expert (None: moe_hidden_dim)
    load_balance_coeff: float | None = 1e-3  # the aux-loss-free bias update speed (None: no bias)
    aux_loss_coeff: float = 0.0  # the sequence-wise auxiliary loss coefficient (0: off)
    n_dense_layers: int = 0  # the first k layers dense (DeepSeek-V3: 3), SwiGLU of ffn_hidden_dim
    experts_impl: str = "auto"  # auto | grouped | loop (titanlike.models.moe.GroupedExperts)

    def replace(self, **changes) -> Qwen3MoeArgs:
        return dataclasses.replace(self, **changes)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            dim=self.dim,
            hidden_dim=self.moe_hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.num_shared_experts,
            shared_hidden_dim=self.shared_hidden_dim,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_coeff=self.aux_loss_coeff,
            experts_impl=self.experts_impl,
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.n_dense_layers, 0)

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        return 2 * d * q + 2 * d * kv + 2 * hd + 2 * d  # projections, q/k norms, the two block norms

    def _params(self, ffn_moe: int, include_embedding: bool) -> int:
        dense = self.n_layers - self.n_moe_layers
        per_dense = 3 * self.dim * self.ffn_hidden_dim
        body = self.n_layers * self._attention_params() + dense * per_dense + self.n_moe_layers * ffn_moe
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return body + self.dim + head + (self.vocab_size * self.dim if include_embedding else 0)

    def num_params(self, include_embedding: bool = True) -> int:
        """Every parameter (all experts; the tied head counted once)."""
        return self._params(self.moe_args().num_params(), include_embedding)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """The parameters one token uses: router, ``top_k`` routed experts and the shared experts per MoE layer."""
        return self._params(self.moe_args().active_params(), include_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """6 x the matmul weights one token uses (router, top-k routed and shared experts; the head counted, tied or
        not) + 12 L (n_heads x head_dim) s for attention (PaLM appendix B, on active parameters)."""
        d, L, q, kv = self.dim, self.n_layers, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        dense = self.n_layers - self.n_moe_layers
        matmul = (
            L * (2 * d * q + 2 * d * kv)
            + dense * 3 * d * self.ffn_hidden_dim
            + self.n_moe_layers * self.moe_args().active_params()
            + self.vocab_size * d
        )
        return 6 * matmul + 12 * L * q * seq_len


_QWEN = dict(vocab_size=151936, rope_theta=1_000_000.0, max_seq_len=40960, head_dim=128, tie_embeddings=False)
FLAVORS: dict[str, Qwen3MoeArgs] = {
    # tiny test shapes: 8 experts, top-2, renormalised, the bias update and a small sequence-wise aux loss on
    "debugmodel": Qwen3MoeArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_hidden_dim=384,
        moe_hidden_dim=96,
        num_experts=8,
        top_k=2,
        load_balance_coeff=1e-2,
        aux_loss_coeff=1e-3,
        max_seq_len=512,
    ),
    "tiny": Qwen3MoeArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=96,
        moe_hidden_dim=32,
        num_experts=8,
        top_k=2,
        load_balance_coeff=5e-2,
        aux_loss_coeff=1e-2,
        n_dense_layers=1,  # the first layer dense (the DeepSeek option), the second MoE
        max_seq_len=256,
    ),
    "30B-A3B": Qwen3MoeArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144, moe_hidden_dim=768, **_QWEN
    ),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_dim=12288, moe_hidden_dim=1536, **_QWEN
    ),
    # DeepSeek-V3's MoE (arXiv 2412.19437: 256 routed experts of 2048, top-8, 1 shared, sigmoid + bias, 8 groups /
    # top-4, route scale 2.5, the first 3 layers dense of 18432) on Qwen3's grouped-query attention, for planning
    "deepseek": Qwen3MoeArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        head_dim=128,
        ffn_hidden_dim=18432,
        moe_hidden_dim=2048,
        num_experts=256,
        top_k=8,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_groups=8,
        topk_groups=4,
        n_dense_layers=3,
        vocab_size=129280,
        max_seq_len=4096,
        rope_theta=10000.0,
        tie_embeddings=False,
    ),
}


def param_init(args: Qwen3MoeArgs) -> Callable[[str], Init]:
    """Every parameter's distribution, by full-model FQN: Hugging Face's Qwen3-MoE init (``initializer_range`` 0.02
    for every projection, the router and every expert, each expert generated on its own), norms ones; a tied head is
    generated as the embedding."""
    emb, proj = normal(0.02), normal(0.02)
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": emb,
            r"layers\.\d+\.(attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm)\.weight": ones(),
            r"layers\.\d+\.(attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))\.weight": proj,
            r"layers\.\d+\.moe\.(router\.gate\.weight|experts\.(w1|w2|w3)|shared_experts\.(w1|w2|w3)\.weight)": proj,
            r"norm\.weight": ones(),
            r"output\.weight": emb.tied_to("tok_embeddings.weight") if args.tie_embeddings else normal(0.02),
        }
    )


class Qwen3MoeBlock(MoEDecoderBlock):
    """``h = x + attention(attention_norm(x))``, then ``h + moe(ffn_norm(h))`` (a dense SwiGLU ``feed_forward`` in
    the first ``n_dense_layers`` layers)."""

    param_init = staticmethod(param_init)
    attention_class = Attention


class Qwen3Moe(RopeTables, Decoder):
    """``tok_embeddings`` -> ``layers`` (Qwen3MoeBlock by global index) -> ``norm`` -> ``output``; RoPE tables as
    root buffers, the expert biases and load counters as the MoE blocks' buffers."""

    param_init = staticmethod(param_init)

    def __init__(self, args: Qwen3MoeArgs):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: Qwen3MoeBlock(i, args), RMSNorm(args.dim, args.norm_eps))
        self._register_rope()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """The RoPE tables, and every MoE block's expert bias (zeros) and load counter."""
        super().init_buffers(device)
        init_moe_buffers(self, device)
