"""Building blocks the decoders share, in plain ``torch.nn``: RMSNorm, rotary position tables, SwiGLU, the pre-norm
residual block.

Norms and RoPE compute in at least float32 (float64 stays float64, so numerics can be compared exactly).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.models.decoder import DecoderBlock

__all__ = [
    "FeedForward",
    "PreNormBlock",
    "RMSNorm",
    "RopeTables",
    "apply_rope",
    "compute_dtype",
    "rope_attention_factor",
    "rope_inv_freq",
    "rope_rows",
    "rope_tables",
    "yarn_mscale",
]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms and RoPE run in at least float32 (float64 stays float64 so numerics can be compared exactly)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``; the paper's sqrt(1/t))."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, args) -> torch.Tensor:
    """YaRN (arXiv 2309.00071, transformers' ``rope_type: yarn``): frequencies that turn fewer than ``beta_slow``
    times over the original context are interpolated (divided by ``factor``), those turning more than ``beta_fast``
    times are kept, with a linear ramp between, over the rotary dims found by the inverse-dimension formula
    (``truncate``: the range's ends rounded outwards, as transformers does by default; gpt-oss turns it off)."""
    factor, old_len = args.rope_scaling_factor, args.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(args.rope_beta_fast), correction_dim(args.rope_beta_slow)
    if getattr(args, "rope_truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(args) -> float:
    """The factor RoPE's cos / sin tables are multiplied by: 1, or YaRN's attention factor (``rope_attention_factor``
    when set, else ``mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim)`` when both are set (DeepSeek),
    else ``mscale(factor)``), as transformers computes it."""
    if args is None or getattr(args, "rope_scaling", "none") != "yarn":
        return 1.0
    if getattr(args, "rope_attention_factor", 0.0):
        return float(args.rope_attention_factor)
    factor = args.rope_scaling_factor
    mscale, mscale_all_dim = getattr(args, "rope_mscale", 0.0), getattr(args, "rope_mscale_all_dim", 0.0)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_inv_freq(head_dim: int, theta: float, args=None) -> torch.Tensor:
    """The head_dim // 2 rotation frequencies theta^(-2i/head_dim), in float64, with ``args.rope_scaling``
    (``head_dim``: the rotated dims, a part of the head under partial rotary embeddings).

    "llama3" (Llama 3.1+, as Meta's reference code and transformers' ``rope_type: llama3``): wavelengths longer than
    ``original_max_seq_len / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_seq_len / high_freq_factor`` are kept, and the band between is interpolated smoothly.
    "yarn" (DeepSeek-V3, gpt-oss, Qwen3 long context; transformers' ``rope_type: yarn``): :func:`_yarn_inv_freq`,
    with the fields ``rope_scaling_factor``, ``rope_original_max_seq_len``, ``rope_beta_fast``, ``rope_beta_slow``
    (and ``rope_truncate``); the tables' scale is :func:`rope_attention_factor`. This is the one place every model's
    RoPE scaling is computed.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = "none" if args is None else getattr(args, "rope_scaling", "none")
    if scaling == "none":
        return inv_freq
    if scaling == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, args)
    if scaling != "llama3":
        raise ValueError(f"rope_scaling {scaling!r}: not one of none, llama3, yarn")
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, args=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2), computed in float64 (``args``: rope scaling; YaRN's
    attention factor multiplies both, as transformers' rotary embedding does)."""
    inv_freq = rope_inv_freq(head_dim, theta, args)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    scale = rope_attention_factor(args)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim) by the position angle (Meta's
    layout; ``cos`` / ``sin``: the rows of the tokens' positions, (seq, head_dim // 2))."""
    dtype = compute_dtype(x)
    xp = x.to(dtype).unflatten(-1, (-1, 2))
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = rope_rows(cos, x, dtype), rope_rows(sin, x, dtype)
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


def rope_rows(table: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of ``table`` for x (batch, seq, heads, head_dim), broadcastable to it: ``table`` (seq, n) is shared by
    the batch, (batch, seq, n) per sample (positions that restart at every document start)."""
    if table.dim() == 3:
        return table[:, : x.shape[1]].to(dtype)[:, :, None, :]
    return table[: x.shape[1]].to(dtype)[None, :, None, :]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _rotary_dim(args) -> int:
    """The rotated dims of a head: ``args.rotary_dim`` (partial rotary embeddings, Qwen3-Next) or all of it."""
    return getattr(args, "rotary_dim", None) or args.head_dim


class RopeTables:
    """Mixed into a :class:`~titanlike.models.decoder.Decoder` whose blocks rotate q and k: the cos / sin tables of
    every position up to ``args.max_seq_len`` as non-persistent root buffers (every pipeline stage keeps them; never
    in a checkpoint), and the blocks' ``cos`` / ``sin`` keyword arguments: the rows of the tokens' positions
    (the position seam's: global positions under context parallelism). ``args``: ``head_dim``, ``max_seq_len``,
    ``rope_theta`` (and the RoPE scaling fields, when it has them)."""

    def _register_rope(self) -> None:
        """The tables in float64 when the model is built in float64 (the default dtype at its construction, as
        the trainer builds a float64 run), float32 otherwise."""
        a = self.args
        cos, sin = rope_tables(_rotary_dim(a), a.max_seq_len, a.rope_theta, a)
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def block_kwargs(self, positions: torch.Tensor) -> dict:
        return {"cos": self.rope_cos[positions], "sin": self.rope_sin[positions]}  # (seq, n) or (batch, seq, n)

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the RoPE tables on ``device`` (float32, or float64 in a float64 model: float64 tables, or
        float64 parameters, e.g. after ``.double()``, which casts the float32 tables' values)."""
        a = self.args
        device = device or self.rope_cos.device
        cos, sin = rope_tables(_rotary_dim(a), a.max_seq_len, a.rope_theta, a)
        param = next(self.parameters(), None)
        float64 = self.rope_cos.dtype == torch.float64 or (param is not None and param.dtype == torch.float64)
        dtype = torch.float64 if float64 else torch.float32
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)


class PreNormBlock(DecoderBlock):
    """``h = x + attention(attention_norm(x), **kwargs)``, then ``h + feed_forward(ffn_norm(h))``: RMSNorms and a
    SwiGLU around the model's own attention (``attention_cls(args)``, called with the block's keyword arguments, e.g.
    the RoPE rows): the block of Llama and Qwen3. Subclasses set ``attention_cls`` and ``param_init``."""

    attention_cls: ClassVar[type[nn.Module]]

    def __init__(self, layer_id: int, args):
        super().__init__(layer_id, args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = self.attention_cls(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), **kwargs)
        return h + self.feed_forward(self.ffn_norm(h))
