"""gpt-oss (OpenAI, 2025: gpt-oss-20b / -120b) in plain ``torch.nn``, as transformers' ``GptOssForCausalLM``
computes it:

* attention: grouped-query (64 heads of 64, 8 kv heads) with biases on q, k, v and o, rotate-half RoPE with YaRN
  scaling (factor 32 over 4096 positions, ``truncate`` off; the one shared implementation,
  ``titanlike.models.layers.rope_inv_freq``), a learned **attention sink** per head (``attention.sinks.weight``,
  joined to each query's softmax and dropped from the output), and **alternating layer types**: even layers a
  128-token sliding window (``sliding_attention``), odd ones full causal (``full_attention``); both through the
  shared seam (``AttentionCore(window=..., sinks=True)``), so every layout and mask applies;
* every layer a mixture of experts on the shared block (``titanlike.models.moe``): a router with a bias, top-k of the
  logits then a softmax over the chosen ones (the shared router's softmax + renormalisation: equal), experts with a
  bias on each projection and the clamped gated activation ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g =
  clamp(gate, max=7)``; no expert bias balancing, no shared experts;
* RMSNorm (eps 1e-5) before attention and experts, untied head.

The checkpoint stores each expert's gate and up projections interleaved in one ``gate_up_proj`` (gate the even
columns, up the odd ones), transposed; the adapter (``titanlike.models.gpt_oss.hf``) splits them into the block's
``w1`` (gate) and ``w3`` (up). Module names: ``tok_embeddings``, ``layers.N.{attention_norm, attention.{wq, wk, wv, wo,
sinks}, ffn_norm, moe.{router.gate, experts.{w1, w2, w3, b1, b2, b3}}}``, ``norm``, ``output``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns, zeros
from titanlike.models.decoder import AttentionCore, Decoder, DecoderBlock
from titanlike.models.layers import RMSNorm, RopeTables
from titanlike.models.moe import MoE, MoEArgs, init_moe_buffers
from titanlike.models.qwen3.model import apply_rope_half

__all__ = ["FLAVORS", "GptOss", "GptOssArgs", "GptOssBlock", "Sinks", "param_init"]

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssArgs:
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    moe_hidden_dim: int = 2880  # per expert (Hugging Face: intermediate_size)
    num_experts: int = 32
    top_k: int = 4
    vocab_size: int = -1
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    sliding_window: int = 128  # the window of the sliding_attention layers (positions, the query included)
    # per layer "sliding_attention" | "full_attention"; empty: alternating, the first sliding (transformers' default)
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    attention_sinks: bool = True
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # YaRN (transformers' rope_parameters of the published checkpoints)
    rope_scaling: str = "yarn"
    rope_scaling_factor: float = 32.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    rope_attention_factor: float = 0.0  # 0: YaRN's mscale of the factor
    load_balance_coeff: float | None = None  # gpt-oss has no expert bias; a float trains one (not exportable)
    aux_loss_coeff: float = 0.0
    experts_impl: str = "auto"

    def replace(self, **changes) -> GptOssArgs:
        return dataclasses.replace(self, **changes)

    @property
    def hidden_dim(self) -> int:
        return self.moe_hidden_dim

    def layer_type(self, layer_id: int) -> str:
        if self.layer_types:
            return self.layer_types[layer_id]
        return LAYER_TYPES[layer_id % 2]

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None: full attention)."""
        return self.sliding_window if self.layer_type(layer_id) == "sliding_attention" else None

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            dim=self.dim,
            hidden_dim=self.moe_hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            score_func="softmax",
            route_norm=True,  # softmax over all, renormalised over the top k = softmax over the chosen logits
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_coeff=self.aux_loss_coeff,
            experts_impl=self.experts_impl,
            router_bias=True,
            expert_bias_terms=True,
            activation="clamped_swiglu",
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )

    def _attention_params(self) -> int:
        d, hd, bias = self.dim, self.head_dim, self.attention_bias
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        return 2 * d * q + 2 * d * kv + bias * (q + 2 * kv + d) + self.n_heads * self.attention_sinks + 2 * d

    def _params(self, moe: int, include_embedding: bool) -> int:
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        body = self.n_layers * (self._attention_params() + moe)
        return body + self.dim + head + (self.vocab_size * self.dim if include_embedding else 0)

    def num_params(self, include_embedding: bool = True) -> int:
        """Every parameter (all experts and biases; the tied head counted once)."""
        return self._params(self.moe_args().num_params(), include_embedding)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """The parameters one token uses: attention, router, ``top_k`` experts per layer."""
        return self._params(self.moe_args().active_params(), include_embedding)

    def attention_keys(self, layer_id: int, seq_len: int) -> int:
        """Keys per query the attention FLOPs count in layer ``layer_id`` (PaLM's convention: the whole row, ``s``;
        a sliding window keeps ``min(window, s)`` of it)."""
        w = self.window_of(layer_id)
        return seq_len if w is None else min(w, seq_len)

    def flops_per_token(self, seq_len: int) -> int:
        """6 x the matmul weights one token uses (router, top-k experts, the head) + 12 (n_heads x head_dim) x the
        keys per query of each layer (PaLM appendix B; a sliding-window layer counts only its window)."""
        d, L, q, kv = self.dim, self.n_layers, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        m = self.moe_args()
        matmul = L * (2 * d * q + 2 * d * kv + d * m.num_experts + 3 * d * m.hidden_dim * m.top_k) + self.vocab_size * d
        return 6 * matmul + 12 * q * sum(self.attention_keys(i, seq_len) for i in range(L))


_PUBLISHED = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, moe_hidden_dim=2880, top_k=4, vocab_size=201088)
FLAVORS: dict[str, GptOssArgs] = {
    # tiny test shapes: a window smaller than the sequence (it acts), 8 experts of 64, top-2
    "debugmodel": GptOssArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        moe_hidden_dim=64,
        num_experts=8,
        top_k=2,
        sliding_window=32,
        max_seq_len=512,
    ),
    # the gates' shapes: a sliding and a full layer, window 4 (the gates' sequences are 16), and a clamp limit that
    # acts at this init's activation scale (0.1; gpt-oss's 7.0 is never reached by a freshly initialised tiny model)
    "tiny": GptOssArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_hidden_dim=32,
        num_experts=4,
        top_k=2,
        sliding_window=4,
        swiglu_limit=0.1,
        max_seq_len=256,
    ),
    "20b": GptOssArgs(n_layers=24, num_experts=32, **_PUBLISHED),
    "120b": GptOssArgs(n_layers=36, num_experts=128, **_PUBLISHED),
}


def param_init(args: GptOssArgs) -> Callable[[str], Init]:
    """Every parameter's distribution, by full-model FQN: transformers' gpt-oss init (``initializer_range`` 0.02 for
    every projection, the sinks, the router (weight and bias) and every expert weight; the projections' and experts'
    biases zero), norms ones."""
    std = normal(0.02)
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": std,
            r"layers\.\d+\.(attention_norm|ffn_norm)\.weight": ones(),
            r"layers\.\d+\.attention\.(wq|wk|wv|wo)\.weight": std,
            r"layers\.\d+\.attention\.(wq|wk|wv|wo)\.bias": zeros(),
            r"layers\.\d+\.attention\.sinks\.weight": std,
            r"layers\.\d+\.moe\.router\.gate\.(weight|bias)": std,
            r"layers\.\d+\.moe\.experts\.(w1|w2|w3)": std,
            r"layers\.\d+\.moe\.experts\.(b1|b2|b3)": zeros(),
            r"norm\.weight": ones(),
            r"output\.weight": std.tied_to("tok_embeddings.weight") if args.tie_embeddings else normal(0.02),
        }
    )


class Sinks(nn.Module):
    """One learned logit per attention head (``weight`` (heads,)); called with no input, returns it (under tensor
    parallelism this rank's heads: sharding entry ``HeadParams``)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class Attention(nn.Module):
    def __init__(self, args: GptOssArgs, layer_id: int):
        super().__init__()
        self.head_dim = hd = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=bias)
        self.sinks = Sinks(args.n_heads) if args.attention_sinks else None
        self.sdpa = AttentionCore(window=args.window_of(layer_id), sinks=args.attention_sinks)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the heads this module holds (all, or this rank's under tensor parallelism)
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        sinks = self.sinks() if self.sinks is not None else None
        return self.wo(self.sdpa(q, k, v, mask, sinks=sinks).reshape(bsz, seqlen, -1))


class GptOssBlock(DecoderBlock):
    """``h = x + attention(attention_norm(x))``, then ``h + moe(ffn_norm(h))``."""

    param_init = staticmethod(param_init)

    def __init__(self, layer_id: int, args: GptOssArgs):
        super().__init__(layer_id, args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args.moe_args())

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), **kwargs)
        return h + self.moe(self.ffn_norm(h))


class GptOss(RopeTables, Decoder):
    """``tok_embeddings`` -> ``layers`` (GptOssBlock by global index) -> ``norm`` -> ``output``; RoPE (YaRN) tables
    as root buffers."""

    param_init = staticmethod(param_init)

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: GptOssBlock(i, args), RMSNorm(args.dim, args.norm_eps))
        self._register_rope()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """The RoPE tables, and every MoE block's load counter (and expert bias, when one is trained)."""
        super().init_buffers(device)
        init_moe_buffers(self, device)
