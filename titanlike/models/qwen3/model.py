"""Qwen3 (dense) in plain ``torch.nn``: grouped-query attention with a per-head RMSNorm of q and k (QK-norm), no
biases, RoPE (theta 1e6) on the rotate-half layout, SwiGLU, RMSNorm, an explicit ``head_dim`` (128, not
``dim / n_heads``), tied embeddings for the small sizes. Shapes as published (Qwen's model cards / config.json and
transformers' ``Qwen3Config``; torchtitan's Qwen3 flavors agree).

Everything the package needs comes from the shared scaffolding (``titanlike.models.decoder``: roles, the forward that
skips a pipeline stage's missing modules, tying, the attention and position seams) and the shared layers
(``titanlike.models.layers``); what is Qwen3's own is here: the QK-norm attention, the rotate-half RoPE (Hugging
Face's layout, so the weights convert by name only), the flavors and the init plan.

Module names: ``tok_embeddings``, ``layers.N.{attention_norm, attention.{wq, wk, wv, wo, q_norm, k_norm},
ffn_norm, feed_forward.{w1, w2, w3}}``, ``norm``, ``output``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns
from titanlike.models.decoder import AttentionCore, Decoder
from titanlike.models.layers import PreNormBlock, RMSNorm, RopeTables, compute_dtype, rope_rows


@dataclass
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # explicit: q is n_heads x head_dim wide, which need not be dim
    ffn_hidden_dim: int = 3072  # the SwiGLU width (config key model.ffn_hidden_dim)
    vocab_size: int = -1  # set from the tokenizer (then padded to ``vocab_multiple``)
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = True

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim

    def replace(self, **changes) -> Qwen3Args:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the full model (the tied head counted once)."""
        d, hd, L = self.dim, self.head_dim, self.n_layers
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        per_layer = 2 * d * q + 2 * d * kv + 3 * d * self.hidden_dim + 2 * hd + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return L * per_layer + d + head + (self.vocab_size * d if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """6 x matmul weights (the head counted, tied or not) + 12 L (n_heads x head_dim) s for attention (PaLM
        appendix B, with the attention width of this model)."""
        d, L, q, kv = self.dim, self.n_layers, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        matmul = L * (2 * d * q + 2 * d * kv + 3 * d * self.hidden_dim) + self.vocab_size * d
        return 6 * matmul + 12 * L * q * seq_len


_SMALL = dict(head_dim=128, n_kv_heads=8, vocab_size=151936, rope_theta=1_000_000.0, max_seq_len=40960)
FLAVORS: dict[str, Qwen3Args] = {
    # tiny test shapes: q (n_heads x head_dim) wider than dim, grouped kv heads, tied like the small sizes
    "debugmodel": Qwen3Args(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_hidden_dim=384, max_seq_len=512
    ),
    "tiny": Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, max_seq_len=256),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, ffn_hidden_dim=3072, tie_embeddings=True, **_SMALL),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, ffn_hidden_dim=6144, tie_embeddings=True, **_SMALL),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, ffn_hidden_dim=12288, tie_embeddings=False, **_SMALL),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, ffn_hidden_dim=25600, tie_embeddings=False, **_SMALL),
}


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves ``(x[i], x[i + head_dim/2])`` of each head of x (batch, seq, heads, head_dim) by the
    position angle (Hugging Face's "rotate half" layout); ``cos`` / ``sin``: (seq, head_dim // 2) rows."""
    dtype = compute_dtype(x)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    c, s = rope_rows(cos, x, dtype), rope_rows(sin, x, dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


def param_init(args: Qwen3Args) -> Callable[[str], Init]:
    """Every parameter's distribution, by full-model FQN: Hugging Face's Qwen3 init (``initializer_range`` 0.02 for
    every projection and the embedding), norms (q/k norms included) ones; a tied head is generated as the
    embedding, an untied one like the projections."""
    emb = normal(0.02)
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": emb,
            r"layers\.\d+\.(attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm)\.weight": ones(),
            r"layers\.\d+\.(attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))\.weight": normal(0.02),
            r"norm\.weight": ones(),
            r"output\.weight": emb.tied_to("tok_embeddings.weight") if args.tie_embeddings else normal(0.02),
        }
    )


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = RMSNorm(hd, args.norm_eps)  # per head, over head_dim
        self.k_norm = RMSNorm(hd, args.norm_eps)
        self.sdpa = AttentionCore()

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the heads this module holds (all, or this rank's under tensor parallelism)
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        return self.wo(self.sdpa(q, k, v, mask).reshape(bsz, seqlen, -1))


class Qwen3Block(PreNormBlock):
    param_init = staticmethod(param_init)
    attention_cls = Attention


class Qwen3(RopeTables, Decoder):
    """``tok_embeddings`` -> ``layers`` (Qwen3Block by global index) -> ``norm`` -> ``output``, RoPE tables as root
    buffers. A pipeline stage is this module with other stages' modules removed."""

    param_init = staticmethod(param_init)

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: Qwen3Block(i, args), RMSNorm(args.dim, args.norm_eps))
        self._register_rope()
