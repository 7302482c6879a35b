"""Incremental decoding: a key/value cache per attention seam, and the positions of left-padded prompts.

Generation (``titanlike.generate``) runs the unchanged model forward on a prompt, then on one token at a time. What
changes is behind the two seams every built-in decoder already calls (``titanlike.models.decoder``), swapped from
outside for the length of a generation as context parallelism swaps them for training:

* each attention seam is asked for its cached counterpart, ``core.kv_cache(state)`` (a method of the seam, so a
  new attention kind brings its own cache: a softmax seam keeps every key and value, a sliding window only the
  keys its window still reaches, with or without attention sinks; linear attention would keep its recurrent
  state); ``None`` means "this kind cannot cache yet", and generation then says so and recomputes the whole
  sequence each step;
* the position seam becomes :class:`CachedPositions`: the positions of the tokens of this step, per row (a prompt
  left-padded by ``p`` tokens starts at position 0 after its padding).

:class:`DecodeState` is the one place the step's geometry is decided (its positions and the key mask every cached
seam of the step shares): where each row's padding ends, how many tokens the cache holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.models.masking import attention_with_sinks

__all__ = [
    "CachedLatentAttention",
    "CachedPositions",
    "CachedSoftmaxAttention",
    "DecodeState",
    "SequenceSeam",
    "UnreadWindow",
    "cache_blockers",
    "kv_cached",
]


class SequenceSeam(nn.Module):
    """Base of every parameter-free module through which a model mixes tokens across the sequence (attention,
    latent attention, a short convolution, a linear-attention recurrence, a window of token ids): context
    parallelism replaces them from outside, and generation asks each for its cached counterpart. The default is
    None ("this kind cannot cache yet"), so a new kind that brings no cache is named by :func:`cache_blockers` and
    recomputed, never decoded one token at a time as if it saw the whole sequence."""

    def kv_cache(self, state: DecodeState) -> nn.Module | None:
        return None


class DecodeState:
    """The geometry of an incremental decode of ``batch`` rows, the first ``pad[b]`` tokens of row ``b`` padding.

    :meth:`begin` (before each forward over ``s`` new tokens) fixes the step's positions ``(batch, s)`` and its
    boolean key mask ``(batch, 1, s, length + s)``: a token sees the tokens up to itself that are not padding (a
    padding token sees only itself, so no row of the softmax is empty); :meth:`end` advances the length.
    """

    def __init__(self, pad: torch.Tensor):
        self.pad = pad  # (batch,) left-padding tokens per row
        self.length = 0  # tokens every cache holds
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.absolute: torch.Tensor | None = None  # (s,) this step's tokens' indices in the padded sequence

    def begin(self, s: int) -> None:
        device = self.pad.device
        self.absolute = absolute = self.length + torch.arange(s, device=device)
        self.positions = (absolute[None, :] - self.pad[:, None]).clamp(min=0)  # (batch, s)
        keys = torch.arange(self.length + s, device=device)
        causal = keys[None, :] <= absolute[:, None]  # (s, keys)
        not_pad = keys[None, :] >= self.pad[:, None]  # (batch, keys)
        itself = keys[None, :] == absolute[:, None]
        self.mask = (causal[None] & (not_pad[:, None, :] | itself[None]))[:, None]  # (batch, 1, s, keys)

    def window_mask(self, window: int) -> torch.Tensor:
        """The step's key mask for a sliding window of ``window`` positions (the query itself included), over the
        step's keys and the last ``window - 1`` earlier ones (all a windowed cache keeps): ``p - window < j <= p``.
        Left padding shifts a row's positions and keys alike, so the padded indices give the same differences."""
        keys = torch.arange(self.length + self.absolute.shape[0], device=self.pad.device)
        near = keys[None, :] > self.absolute[:, None] - window  # (s, keys)
        kept = min(keys.shape[0], window - 1 + self.absolute.shape[0])
        return (self.mask & near[None, None])[..., -kept:]

    def end(self, s: int) -> None:
        self.length += s

    def real(self) -> torch.Tensor:
        """(batch, s) True at this step's tokens that are not left padding."""
        return self.absolute[None, :] >= self.pad[:, None]


class CachedPositions(nn.Module):
    """The position seam during a decode: the state's positions of this step's tokens, ``(batch, s)``."""

    def __init__(self, state: DecodeState):
        super().__init__()
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.state.positions
        if positions is None or positions.shape != x.shape[:2]:
            raise RuntimeError("CachedPositions: DecodeState.begin(s) was not called for this forward")
        return positions


class CachedSoftmaxAttention(nn.Module):
    """The softmax attention seam with a cache: this step's keys and values appended to those of the earlier
    steps, then every query attends over all of them under the state's mask. Grouped-query heads as in
    ``AttentionCore`` (kv head ``i // n_rep`` serves query head ``i``); the cache holds the kv heads only (the
    local ones under tensor parallelism). ``window``: a sliding window of that many positions (the cache keeps
    only the last ``window - 1`` keys and values); ``sinks`` (heads,) at call time: one sink logit per head joins
    the softmax (``AttentionCore``'s options, the same formula as its exact path)."""

    def __init__(self, state: DecodeState, window: int | None = None):
        super().__init__()
        self.state, self.window = state, window
        self.k: torch.Tensor | None = None  # (batch, cached, kv_heads, head_dim)
        self.v: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, sinks=None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("a cached decode runs causal attention over padded prompts; no document mask")
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=1), torch.cat((self.v, v), dim=1)
        keep = self.state.mask if self.window is None else self.state.window_mask(self.window)
        drop = 0 if self.window is None else max(0, k.shape[1] - (self.window - 1))  # what no later query reaches
        self.k, self.v = k[:, drop:], v[:, drop:]
        return _attend(q, k, v, keep, sinks)


class CachedLatentAttention(nn.Module):
    """The latent attention seam (``LatentAttentionCore``) with a cache: it keeps the compressed latent and the
    shared RoPE key of every token (``kv_lora_rank + qk_rope_head_dim`` numbers a token: 576 for DeepSeek-V3, not
    the per-head keys and values), expands them with the model's ``expand`` each step, then attends as the
    softmax cache does."""

    def __init__(self, state: DecodeState):
        super().__init__()
        self.state = state
        self.latent: torch.Tensor | None = None  # (batch, cached, kv_lora_rank)
        self.k_rope: torch.Tensor | None = None  # (batch, cached, 1, qk_rope_head_dim)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, expand, mask=None):
        if mask is not None:
            raise ValueError("a cached decode runs causal attention over padded prompts; no document mask")
        if self.latent is not None:
            latent, k_rope = torch.cat((self.latent, latent), dim=1), torch.cat((self.k_rope, k_rope), dim=1)
        self.latent, self.k_rope = latent, k_rope
        k, v = expand(latent, k_rope)
        return _attend(q, k, v, self.state.mask)


class UnreadWindow(nn.Module):
    """The window seam (``SequenceWindow``) during a decode: only training-mode modules read it (multi-token
    prediction's tokens ahead), and a decode runs the model in eval mode; a call is an error, not a guess."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("SequenceWindow is read in training only (multi-token prediction); a decode runs eval()")


def _attend(q, k, v, keep: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of ``q`` (batch, s, heads, d) over the cached ``k``, ``v`` (batch, n, kv_heads, d) where
    ``keep`` (batch, 1, s, n) allows, grouped-query heads as in ``AttentionCore``, sinks (heads,) as its exact path."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1 and sinks is not None:  # the explicit sinks path (its scores cost more than the repeat)
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sinks is not None:
        return attention_with_sinks(q, k, v, keep, sinks).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=n_rep > 1).transpose(1, 2)


def _seams(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(owner, attribute, module) of every module that has a ``kv_cache`` method (the seams)."""
    for owner in model.modules():
        for name, child in owner.named_children():
            if callable(getattr(child, "kv_cache", None)):
                yield owner, name, child


def cache_blockers(model: nn.Module) -> list[str]:
    """Why ``model`` cannot decode with a cache (empty: it can): no position seam or attention seam reached through
    a ``kv_cache`` method, or a seam whose ``kv_cache`` returns None (its attention kind has no cache yet)."""
    probe = DecodeState(torch.zeros(1, dtype=torch.long))
    seams = [(f"{type(owner).__name__}.{name}", child, child.kv_cache(probe)) for owner, name, child in _seams(model)]
    if not seams:
        return [f"{type(model).__name__} calls its attention through no seam with a kv_cache method"]
    problems = [f"{where} ({type(child).__name__}) has no cache" for where, child, cached in seams if cached is None]
    if not any(isinstance(cached, CachedPositions) for _, _, cached in seams):
        problems.append(f"{type(model).__name__} has no position seam (titanlike.models.decoder.Positions)")
    return sorted(set(problems))


@contextlib.contextmanager
def kv_cached(model: nn.Module, state: DecodeState) -> Iterator[nn.Module]:
    """``model`` with every seam replaced by its cached counterpart for ``state`` (restored on exit). Check
    :func:`cache_blockers` first: a seam without a cache is an error here."""
    swapped = []
    try:
        for owner, name, child in list(_seams(model)):
            cached = child.kv_cache(state)
            if cached is None:
                raise ValueError(f"{type(owner).__name__}.{name} ({type(child).__name__}) has no kv cache")
            setattr(owner, name, cached)
            swapped.append((owner, name, child))
        yield model
    finally:
        for owner, name, child in swapped:
            setattr(owner, name, child)
