"""A Llama-style decoder in plain ``torch.nn``: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model knows nothing of parallelism. Three properties make it easy to parallelize from the outside:

* attention infers its number of heads from the (possibly sharded) projection outputs, so tensor parallelism
  only has to shard ``wq/wk/wv`` column-wise and ``wo`` row-wise;
* layers live in an ``nn.ModuleDict`` keyed by their global index, so a pipeline stage built with
  ``Transformer(args, layer_ids=range(4, 8), has_embedding=False)`` keeps the full model's parameter names
  (``layers.5.attention.wq.weight``) and checkpoints load across layouts;
* it can be built on the meta device and materialised later with :meth:`Transformer.init_weights`, whose values are
  a pure function of (seed, parameter FQN, element index) (:func:`param_init`, ``titanlike.init``): a sharded
  model fills each rank's shards with exactly the single-device values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.init import Init, init_parameters, normal, ones, plan_from_patterns, trunc_normal


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


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms and RoPE run in at least float32 (float64 stays float64 so numerics can be compared exactly)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_compute_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_inv_freq(head_dim: int, theta: float, args: ModelArgs | None = None) -> torch.Tensor:
    """The head_dim // 2 rotation frequencies theta^(-2i/head_dim), in float64, with ``args.rope_scaling``.

    "llama3" (Llama 3.1+, as Meta's reference code and transformers' ``rope_type: llama3``): wavelengths longer than
    ``original_max_seq_len / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_seq_len / high_freq_factor`` are kept, and the band between is interpolated smoothly.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if args is None or args.rope_scaling == "none":
        return inv_freq
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, args: ModelArgs | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2), computed in float64 (``args``: rope scaling)."""
    inv_freq = rope_inv_freq(head_dim, theta, args)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim) by the position angle."""
    dtype = _compute_dtype(x)
    xp = x.to(dtype).unflatten(-1, (-1, 2))
    x0, x1 = xp[..., 0], xp[..., 1]
    c = cos[: x.shape[1]].to(dtype)[None, :, None, :]
    s = sin[: x.shape[1]].to(dtype)[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class CausalAttention(nn.Module):
    """The attention core, a swap point: causal softmax attention of ``q`` (batch, seq, heads, head_dim) over
    ``k``, ``v`` (batch, seq, kv_heads, head_dim), kv heads shared by groups of query heads; returns (batch, seq,
    heads, head_dim). No parameters. Context parallelism replaces it from outside
    (``titanlike.parallel.context_parallel.ContextParallelAttention``) without touching the projections."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the number of heads this module holds (all of them, or the local ones under tensor parallelism).
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(q, k, v)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos=cos, sin=sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, seed: int | None = None):
        """This block's weights as the full model's init makes them (``seed``: default ``torch.initial_seed()``)."""
        init_parameters(self, param_init(self.args), _seed(seed), prefix=f"layers.{self.layer_id}.")


def _seed(seed: int | None) -> int:
    return torch.initial_seed() if seed is None else seed


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


class Transformer(nn.Module):
    """The decoder, or a contiguous part of it (a pipeline stage).

    ``layer_ids`` selects which blocks this module holds; ``has_embedding`` / ``has_head`` whether it owns the
    token embedding (input: token ids) and the final norm + output head (output: logits). A stage without the
    embedding takes hidden states; one without the head returns hidden states.
    """

    def __init__(
        self, args: ModelArgs, layer_ids: Iterable[int] | None = None, has_embedding: bool = True, has_head: bool = True
    ):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size is not set: take it from the tokenizer")
        self.args = args
        layer_ids = range(args.n_layers) if layer_ids is None else list(layer_ids)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in layer_ids})
        self.norm = RMSNorm(args.dim, args.norm_eps) if has_head else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if has_head else None
        if args.tie_embeddings and has_embedding and has_head:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None):
        """(Re)compute the RoPE tables (non-persistent buffers, never in a checkpoint) on ``device``."""
        device = device or self.rope_cos.device
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.args)
        dtype = self.rope_cos.dtype if self.rope_cos.dtype == torch.float64 else torch.float32
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None):
        """(Re)initialise every buffer and parameter, sharded (DTensor) ones too, each rank its own elements:
        :func:`param_init` from ``seed`` (default ``torch.initial_seed()``), the same values under every layout."""
        self.init_buffers(buffer_device)
        init_parameters(self, param_init(self.args), _seed(seed))
