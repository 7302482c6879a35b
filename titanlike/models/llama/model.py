"""A Llama-style decoder in plain ``torch.nn``: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model knows nothing of parallelism. What makes it easy to parallelize from the outside:

* attention infers its number of heads from the (possibly sharded) projection outputs, so tensor parallelism
  only has to shard ``wq/wk/wv`` column-wise and ``wo`` row-wise (models/llama/sharding.py);
* it is a :class:`~titanlike.models.decoder.Decoder`: layers in an ``nn.ModuleDict`` keyed by their global index,
  so a pipeline stage (the model with the other stages' modules removed) keeps the full model's parameter names
  (``layers.5.attention.wq.weight``) and checkpoints load across layouts; attention through the shared seam and
  RoPE rows from the shared position seam, both of which context parallelism swaps;
* it can be built on the meta device and materialised later with :meth:`Transformer.init_weights`, whose values are
  a pure function of (seed, parameter FQN, element index) (:func:`param_init`, ``titanlike.init``): a sharded
  model fills each rank's shards with exactly the single-device values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns, trunc_normal
from titanlike.models.decoder import AttentionCore, Decoder
from titanlike.models.layers import PreNormBlock, RMSNorm, RopeTables, apply_rope


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1  # set from the tokenizer (then padded to ``vocab_multiple``)
    multiple_of: int = 256  # SwiGLU hidden size rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None  # explicit hidden size; overrides the Llama rule above
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # RoPE frequency scaling: "none" or "llama3" (Llama 3.1's long-context rule, see ``rope_inv_freq``).
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.rope_scaling not in ("none", "llama3"):
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not 'none' or 'llama3'")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled and rounded up as in Llama."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the full model (the tied head counted once)."""
        d, L, kv = self.dim, self.n_layers, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + 2 * d * kv + 3 * d * self.hidden_dim + 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return L * per_layer + d + head + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 * (non-embedding matmul params) + attention (12 * L * d * s).

        The convention of the PaLM paper (appendix B) as used by torchtitan: forward 2 FLOPs per multiply-add,
        backward twice the forward; the attention term counts QK^T and AV for every position (causal masking
        is not discounted); the input embedding is a lookup and is not counted, the output head is.
        """
        matmul_params = self.num_params(include_embedding=False) - (2 * self.n_layers + 1) * self.dim
        if self.tie_embeddings:
            matmul_params += self.vocab_size * self.dim
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len


def pad_vocab(vocab_size: int, multiple: int) -> int:
    return multiple * ((vocab_size + multiple - 1) // multiple) if multiple > 1 else vocab_size


# Flavors. Vocab sizes are the tokenizer's; llama3 flavors use the Llama-3 128,256 vocabulary.
FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64, max_seq_len=512, rope_theta=10000.0
    ),
    "tiny": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=256),
    "gpt2_small": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_hidden_dim=3072,
        vocab_size=50257,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=131072,
    ),
}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.sdpa = AttentionCore()

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the number of heads this module holds (all of them, or the local ones under tensor parallelism).
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(q, k, v, mask)
        return self.wo(out.reshape(bsz, seqlen, -1))


def param_init(args: ModelArgs) -> Callable[[str], Init]:
    """Every parameter's distribution, by full-model FQN.

    Projections reading the residual stream: truncated normal, std 0.02; those writing into it (``wo``, ``w2``,
    ``w3``) are depth-scaled, std 0.02 / sqrt(2 (layer + 1)). Norms: ones. An untied embedding: N(0, 1); a tied
    table is also the output head, whose token logit starts near std x dim after the final norm, so it gets GPT-2's
    0.02, and every copy of it (a last pipeline stage's ``output.weight``) is generated as ``tok_embeddings.weight``.
    An untied head: truncated normal, std dim^-1/2, cut at 3 std.
    """
    d = args.dim

    def residual(m):
        return trunc_normal(0.02 / math.sqrt(2 * (int(m.group(1)) + 1)))

    tied = normal(0.02)
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": tied if args.tie_embeddings else normal(1.0),
            r"layers\.\d+\.(attention_norm|ffn_norm)\.weight": ones(),
            r"layers\.\d+\.(attention\.(wq|wk|wv)|feed_forward\.w1)\.weight": trunc_normal(0.02),
            r"layers\.(\d+)\.(attention\.wo|feed_forward\.w2|feed_forward\.w3)\.weight": residual,
            r"norm\.weight": ones(),
            r"output\.weight": tied.tied_to("tok_embeddings.weight")
            if args.tie_embeddings
            else trunc_normal(d**-0.5, a=-3 * d**-0.5, b=3 * d**-0.5),
        }
    )


class TransformerBlock(PreNormBlock):
    param_init = staticmethod(param_init)
    attention_cls = Attention


class Transformer(RopeTables, Decoder):
    """The decoder: ``tok_embeddings`` -> ``layers`` (TransformerBlock by global index) -> ``norm`` -> ``output``,
    with the RoPE tables as root buffers. A pipeline stage is this module with other stages' modules removed
    (``titanlike.parallel.pipeline.build_stage``): without the embedding it takes hidden states, without the head it
    returns them."""

    param_init = staticmethod(param_init)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: TransformerBlock(i, args), RMSNorm(args.dim, args.norm_eps))
        self._register_rope()
