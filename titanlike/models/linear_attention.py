"""The linear-attention seam: token mixers whose state is a fixed-size matrix, next to softmax attention.

A linear-attention layer (Gated DeltaNet here; KDA and Mamba2 have the same shape) reads the sequence through two
parameter-free seams, so that context parallelism replaces them from outside as it replaces
``titanlike.models.decoder.AttentionCore`` (``titanlike.parallel.state_passing``):

* :class:`ShortConvCore` -- the taps of a short causal depthwise convolution: ``taps(x, kernel, mask)`` returns
  ``(batch, seq, channels, kernel)`` with ``taps[..., t, c, i] = x[t - (kernel - 1) + i, c]`` (zero before the
  window and, under document masking, before the token's document start). The layer multiplies by its weight
  (``(taps * w).sum(-1)``): the conv of HF's ``causal_conv1d_fn`` without bias. Under context parallelism the
  taps of a piece's first ``kernel - 1`` tokens read the previous piece's last inputs (the halo).
* :class:`GatedDeltaCore` -- the gated delta rule (Yang, Kautz, Hatamizadeh, arXiv 2412.06464) over L2-normalised
  ``q, k`` (batch, seq, k_heads, dk), ``v`` (batch, seq, v_heads, dv), the log-decay ``g`` and the write strength
  ``beta`` (batch, seq, v_heads); each k head serves ``v_heads / k_heads`` consecutive v heads. Per v head, with the
  state ``S`` (dk, dv) starting at zero::

      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t / sqrt(dk)

  :func:`chunk_gated_delta_rule` computes it by chunks of ``chunk_size`` tokens (the WY / UT form: a triangular
  solve per chunk, then a scan over chunks), :func:`recurrent_gated_delta_rule` token by token (the exact form the
  chunked one is tested against). Both take an initial state and return the final one.

**Document masking.** With the forward's :class:`~titanlike.models.masking.DocumentMask` (``starts``: each token's
document start, ``positions``: the tokens' window positions, global under context parallelism) the state is reset at
every document start and the conv reads no token of an earlier document: a packed sequence equals its documents run
one by one. In the chunked form a reset is a 0/1 factor on the decays (token ``j`` reaches token ``i`` of the same
chunk iff ``start_i <= position_j``; the state entering a chunk reaches token ``i`` iff ``start_i`` lies before the
chunk), exact in every dtype: no ``-inf`` in the log-decays.

**Why context parallelism needs only a state.** For fixed ``q, k, g, beta`` the recurrence is affine in the initial
state ``S_0``: ``S_t = M_t S_0 + B_t`` with ``M_t`` (dk, dk) and ``o_t = o_t^0 + S_0^T (M_t^T q_t)``. The columns of
the state evolve independently, so one run with the values widened to ``[v | 0]`` and the initial state ``[0 | I]``
gives the zero-state outputs ``o^0``, the final ``B``, and in the extra columns the final map ``M`` and the
correction rows ``M_t^T q_t`` (:func:`state_affine`). That is what a context-parallel rank computes for its piece.

Compute dtype: at least float32 (float64 stays float64), as transformers' torch fallback computes in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titanlike.models.kv_cache import DecodeState, SequenceSeam
from titanlike.models.masking import DocumentMask

__all__ = [
    "GatedDeltaCore",
    "ShortConvCore",
    "chunk_gated_delta_rule",
    "conv_taps",
    "fla_kernel",
    "l2norm",
    "recurrent_gated_delta_rule",
    "state_affine",
]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------------------ the conv taps
def conv_taps(
    x: Tensor,
    kernel: int,
    starts: Tensor | None = None,
    positions: Tensor | None = None,
    halo: Tensor | None = None,
) -> Tensor:
    """``(batch, seq, channels, kernel)``: tap ``i`` of token ``t`` is ``x[t - (kernel - 1) + i]``. ``halo``
    (batch, kernel - 1, channels): the inputs before the first token (default zeros). ``starts`` (batch, seq),
    ``positions`` (seq,) contiguous: a tap before its token's document start reads zero."""
    b, s, c = x.shape
    pad = x.new_zeros(b, kernel - 1, c) if halo is None else halo.to(x.dtype)
    xp = torch.cat([pad, x], dim=1)
    taps = []
    for i in range(kernel):
        xi = xp[:, i : i + s]
        if starts is not None:
            back = kernel - 1 - i
            keep = (positions - back)[None, :] >= starts  # the tap's token lies in the token's document
            xi = xi * keep[..., None].to(xi.dtype)
        taps.append(xi)
    return torch.stack(taps, dim=-1)


class ShortConvCore(SequenceSeam):
    """The short-convolution seam (no parameters): ``core(x (batch, seq, channels), kernel, mask=None)`` -> taps
    ``(batch, seq, channels, kernel)`` (:func:`conv_taps`); under document masking no tap crosses a document start.
    Context parallelism replaces it (``titanlike.parallel.state_passing.ContextParallelShortConv``: the halo)."""

    def forward(self, x: Tensor, kernel: int, mask: DocumentMask | None = None) -> Tensor:
        if mask is None:
            return conv_taps(x, kernel)
        return conv_taps(x, kernel, mask.starts, mask.positions)

    def kv_cache(self, state: DecodeState) -> nn.Module | None:
        """During a decode: :class:`CachedShortConv` (the last ``kernel - 1`` inputs of each row)."""
        return CachedShortConv(state) if type(self).forward is ShortConvCore.forward else None


class CachedShortConv(nn.Module):
    """The short-convolution seam during a decode: the taps of this step's tokens read the previous steps' last
    ``kernel - 1`` inputs (the halo, as context parallelism's); a left-padding token's input is zero, so a row's
    first real token reads zeros before it, as at the start of a sequence."""

    def __init__(self, state: DecodeState):
        super().__init__()
        self.state = state
        self.halo: Tensor | None = None  # (batch, kernel - 1, channels)

    def forward(self, x: Tensor, kernel: int, mask: DocumentMask | None = None) -> Tensor:
        if mask is not None:
            raise ValueError("a cached decode runs causal attention over padded prompts; no document mask")
        x = x * self.state.real()[..., None].to(x.dtype)
        taps = conv_taps(x, kernel, halo=self.halo)
        seen = x if self.halo is None else torch.cat([self.halo.to(x.dtype), x], dim=1)
        self.halo = torch.cat([x.new_zeros(x.shape[0], kernel - 1, x.shape[2]), seen], dim=1)[:, -(kernel - 1) :]
        return taps


# ------------------------------------------------------------------------------------------------ the delta rule
def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _expand_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # each k head serves rep consecutive v heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return q, k


def _doc_masks(starts: Tensor, positions: Tensor, pad: int, chunk: int):
    """0/1 masks of a padded sequence (batch, n, C...): ``same`` (b, 1, n, C, C) token j reaches token i (same
    document, j <= i), ``carry`` (b, 1, n, C) the state entering the chunk reaches token i."""
    if pad:  # padding tokens continue the last document (they write nothing: k = beta = 0)
        starts = torch.cat([starts, starts[:, -1:].expand(-1, pad)], dim=1)
        positions = torch.cat([positions, positions[-1] + 1 + torch.arange(pad, device=positions.device)])
    b = starts.shape[0]
    st = starts.view(b, -1, chunk)  # (b, n, C)
    pos = positions.view(-1, chunk)  # (n, C)
    same = st[:, :, :, None] <= pos[None, :, None, :]  # start_i <= position_j
    carry = st < pos[None, :, :1]  # start_i before the chunk's first position
    return same[:, None], carry[:, None]


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    starts: Tensor | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule by chunks (module docstring). ``q, k`` (b, s, hk, dk) L2-normalised, ``v`` (b, s, hv,
    dv), ``g, beta`` (b, s, hv); ``initial_state`` (b, hv, dk, dv) or None (zero); ``starts`` (b, s) / ``positions``
    (s,): document resets. Returns the output (b, s, hv, dv) in ``v``'s dtype and the final state (compute dtype)."""
    out_dtype, dtype = v.dtype, _compute_dtype(v)
    q, k = _expand_heads(q, k, v)
    # (b, h, s, ...), contiguous: every later view folds without a copy, whether or not the chunks need padding
    q, k, v, beta, g = (x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v, beta, g))
    b, h, s, dk = k.shape
    dv, C = v.shape[-1], chunk_size
    q = q * dk**-0.5
    pad = (C - s % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (s + pad) // C
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, C, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(b, h, n, C).cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    carry_q = cum.exp()  # (b, h, n, C): decay from the chunk start
    carry_k = (cum[..., -1:] - cum).exp()  # decay to the chunk end
    chunk_decay = cum[..., -1].exp()  # (b, h, n)
    if starts is not None:
        same, carry = _doc_masks(starts, positions, pad, C)
        pair = pair * same.to(dtype)
        carry_q = carry_q * carry.to(dtype)
        carry_k = carry_k * same[..., -1, :].to(dtype)  # token j reaches the chunk's last token
        chunk_decay = chunk_decay * carry[..., -1].to(dtype)
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * carry_q[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair
    q_dec, k_dec = q * carry_q[..., None], k * carry_k[..., None]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    outs = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q_dec[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * C, dv)[:, :, :s]
    return out.transpose(1, 2).to(out_dtype), state


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    starts: Tensor | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The same recurrence token by token (the exact reference form; same arguments and results as
    :func:`chunk_gated_delta_rule`)."""
    out_dtype, dtype = v.dtype, _compute_dtype(v)
    q, k = _expand_heads(q, k, v)
    q, k, v, beta, g = (x.transpose(1, 2).to(dtype) for x in (q, k, v, beta, g))
    b, h, s, dk = k.shape
    q = q * dk**-0.5
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(s):
        decay = g[:, :, t].exp()
        if starts is not None:  # a document starts here: the state is dropped
            decay = decay * (starts[:, t] < positions[t]).to(dtype)[:, None]
        state = state * decay[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).to(out_dtype), state


def state_affine(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    starts: Tensor | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A piece of the sequence from a zero state, and its affine map on the state entering it (module docstring):
    ``(out0 (b, s, hv, dv), corr (b, s, hv, dk), B (b, hv, dk, dv), M (b, hv, dk, dk))`` with, for an entering state
    ``S``, the outputs ``out0 + einsum(corr, S)`` (``o_t += S^T corr_t``) and the leaving state ``M S + B``. One run
    of the chunked rule with the values widened to ``[v | 0]`` and the initial state ``[0 | I]``."""
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    dtype = _compute_dtype(v)
    wide = torch.cat([v.to(dtype), v.new_zeros(*v.shape[:3], dk, dtype=dtype)], dim=-1)
    eye = torch.eye(dk, dtype=dtype, device=v.device).expand(b, hv, dk, dk)
    init = torch.cat([v.new_zeros(b, hv, dk, dv, dtype=dtype), eye], dim=-1)
    out, final = chunk_gated_delta_rule(
        q, k, wide, g, beta, chunk_size=chunk_size, initial_state=init, starts=starts, positions=positions
    )
    return out[..., :dv].to(v.dtype), out[..., dv:], final[..., :dv], final[..., dv:]


class GatedDeltaCore(SequenceSeam):
    """The gated-delta-rule seam (no parameters): ``core(q, k, v, g, beta, mask=None)`` -> (batch, seq, v_heads, dv),
    from a zero state, reset at every document start under ``mask``. ``chunk_size``: the chunked form's chunk (64);
    ``form``: "chunked" (default) or "recurrent" (token by token, exact reference). On CUDA, with
    flash-linear-attention installed and no document mask, its ``chunk_gated_delta_rule`` kernel runs instead
    (``use_kernels``; never in float64). Context parallelism replaces this module
    (``titanlike.parallel.state_passing.ContextParallelGatedDelta``)."""

    def __init__(self, chunk_size: int = 64, form: str = "chunked", use_kernels: bool = True):
        super().__init__()
        if form not in ("chunked", "recurrent"):
            raise ValueError(f"GatedDeltaCore: form must be 'chunked' or 'recurrent', got {form!r}")
        self.chunk_size, self.form, self.use_kernels = chunk_size, form, use_kernels

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, form={self.form}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mask: DocumentMask | None = None):
        kernel = fla_kernel() if self.use_kernels and mask is None and v.is_cuda and v.dtype != torch.float64 else None
        if kernel is not None:
            q, k = _expand_heads(q, k, v)
            return kernel(q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5)[0]
        starts, positions = (None, None) if mask is None else (mask.starts, mask.positions)
        if self.form == "recurrent":
            return recurrent_gated_delta_rule(q, k, v, g, beta, starts=starts, positions=positions)[0]
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, starts=starts, positions=positions)[
            0
        ]

    def kv_cache(self, state: DecodeState) -> nn.Module | None:
        """During a decode: :class:`CachedGatedDelta` (each row's state, fixed size)."""
        return (
            CachedGatedDelta(state, self.chunk_size, self.form)
            if type(self).forward is GatedDeltaCore.forward
            else None
        )


class CachedGatedDelta(nn.Module):
    """The gated-delta-rule seam during a decode: it keeps each row's state ``S`` (batch, v_heads, dk, dv) and runs
    this step's tokens from it (the chunked or recurrent form of the seam). A left-padding token writes nothing and
    decays nothing (``k = beta = g = 0``), so a row's state starts at zero at its first real token."""

    def __init__(self, state: DecodeState, chunk_size: int, form: str):
        super().__init__()
        self.state, self.chunk_size, self.form = state, chunk_size, form
        self.S: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mask: DocumentMask | None = None):
        if mask is not None:
            raise ValueError("a cached decode runs causal attention over padded prompts; no document mask")
        real = self.state.real()[..., None]  # (batch, s, 1)
        k, g, beta = k * real[..., None].to(k.dtype), g * real.to(g.dtype), beta * real.to(beta.dtype)
        if self.form == "recurrent":
            out, self.S = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=self.S)
        else:
            out, self.S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=self.S)
        return out


def fla_kernel():
    """flash-linear-attention's chunked kernel when installed (a kernel backend, never required), else None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # not installed, or no triton
        return None
    return fla_chunk
