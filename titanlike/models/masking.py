"""Document masking (``model.attn_mask_type = "block_causal"``): packed documents never attend to each other.

Pre-training packs documents end to end, each followed by the tokenizer's end-of-text token (EOS), and cuts the
stream into windows. With the block-causal ("document") mask token ``i`` attends to token ``j`` iff ``j <= i`` and
both lie in the same document; a window that starts inside a document treats that part as a document of its own.

**What travels with a batch.** Documents are contiguous, so "``j <= i`` and same document" is "``start[i] <= j <=
i``", where ``start[i]`` is the window position at which token ``i``'s document begins (:func:`document_starts`, from
the document boundaries: a document begins at position 0 and after every EOS; the EOS itself ends its document).
That one ``(batch, seq)`` integer tensor is the batch's document information. It is derived once, on the data side
(``titanlike.data``, from the whole window, before context parallelism cuts it like the inputs), and carried with
each (micro)batch as the model's ``document_starts`` keyword argument: the pipeline schedules split keyword tensors
by microbatch like the inputs, so each microbatch keeps its own. Why starts and not document ids: the mask of a
query is then a function of the query alone (its global position and its document's start), so a context-parallel
rank builds the mask of its chunks against the whole sequence's keys with no collective, and position reset
(``model.reset_position_ids``) is ``position - start``.

**Backends** (:meth:`DocumentMask.attend`, chosen by device, one place):

* CUDA: FlexAttention with a ``BlockMask`` built from the starts (``create_block_mask``: block sparsity, never a
  ``seq x seq`` tensor), once per (micro)batch forward and shared by every layer; ``flex_attention`` compiled;
* elsewhere (CPU): the exact path, a boolean ``(batch, 1, queries, keys)`` mask through SDPA (built once per forward,
  shared by the layers). FlexAttention also runs on CPU (its eager reference), and both agree in float64
  (``tests/models/test_masking.py``); SDPA is the default there (it is what the gate measures).

``causal`` (no ``document_starts``) keeps the plain causal fast path of every seam.

**Sliding windows and attention sinks** (gpt-oss, Mistral, Qwen2's ``use_sliding_window``; per layer, declared by
the model on its seam: ``AttentionCore(window=w, sinks=True)``, docs/gpt_oss.md). Window ``w``: a query at position
``p`` sees the keys at ``p - w < j <= p`` (``w`` positions, itself included: transformers' ``sliding_window_overlay``,
``kv_idx > q_idx - sliding_window``), and under ``block_causal`` only those of its own document
(:func:`window_keys` gives the key range a run of queries needs: bounded by ``w``, which is what context
parallelism gathers). Sinks: one logit per head joined to every query's softmax as an extra column and dropped from
the output (``out * sigmoid(lse - sink)``, the log-sum-exp identity). A model whose seams have a window or sinks
gets a mask even without documents (:meth:`DocumentMask.causal`: every start 0), so that the block masks are built
outside the compiled blocks too. Backends: CPU an exact boolean mask through SDPA, with sinks an explicit softmax
over ``[scores | sink]`` (float64-exact, transformers' eager formula); CUDA FlexAttention with the window in the
block mask and the sinks from its log-sum-exp (``return_lse``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "MASK_TYPES",
    "DocumentMask",
    "attention_backend",
    "attention_with_sinks",
    "cp_gathered_tokens",
    "document_starts",
    "window_keys",
    "window_tail",
]

MASK_TYPES = ("causal", "block_causal")


def document_starts(inputs: Tensor, eos_id: int) -> Tensor:
    """``(batch, seq)`` int64: for every token of ``inputs`` (batch, seq) the window position where its document
    starts (0 for the part of a document the window starts inside; ``p + 1`` after an EOS at ``p``)."""
    if inputs.dim() != 2:
        raise ValueError(f"document_starts: inputs must be (batch, seq), got shape {tuple(inputs.shape)}")
    b, s = inputs.shape
    pos = torch.arange(s, device=inputs.device).expand(b, s)
    begins = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
    begins[:, 0] = True
    begins[:, 1:] = inputs[:, :-1] == eos_id
    return torch.where(begins, pos, torch.zeros_like(pos)).cummax(dim=1).values


def attention_backend(device: torch.device) -> str:
    """The block-causal backend on ``device``: "flex" (FlexAttention, block mask) on CUDA, "sdpa" (exact boolean
    mask) elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def window_keys(first: int, last: int, window: int | None) -> tuple[int, int]:
    """The key positions ``[lo, hi)`` a contiguous run of queries at positions ``first .. last`` can see: ``[0,
    last + 1)`` under full attention, ``[max(0, first - window + 1), last + 1)`` under a sliding window (the one
    place this range is decided: the masks are built for it, context parallelism hands exactly these keys)."""
    return (0 if window is None else max(0, first - window + 1)), last + 1


def _is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (shapes only: no values to build a mask from)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def window_tail(chunk: int, window: int | None) -> int | None:
    """Context parallelism's decision for a layer (chunks of ``chunk`` tokens): the ``window - 1`` keys / values of
    the end of every chunk that a sliding window reaches into the next one, when they fit a chunk (only those are
    gathered); None: full attention, or a window wider than a chunk (every key gathered)."""
    return window - 1 if window is not None and window - 1 <= chunk else None


def cp_gathered_tokens(seq_len: int, cp: int, window: int | None) -> int:
    """Tokens of K (and of V) a context-parallel layer all-gathers (every rank's share together): ``seq_len``, or
    ``2 cp (window - 1)`` for a sliding window that fits a chunk (bounded by the window, not the sequence)."""
    tail = window_tail(seq_len // (2 * cp), window)
    return seq_len if tail is None else 2 * cp * tail


_compiled_flex = None


def _flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask,
    return_lse: bool = False,
    compiled: bool | None = None,
    enable_gqa: bool = False,
):
    """FlexAttention: compiled on CUDA (``compiled`` None), its eager reference elsewhere (tests compare it with the
    SDPA path on CPU, and run the compiled kernel on CPU with ``compiled=True``: float32, forward only).
    ``enable_gqa``: ``k``, ``v`` have fewer heads, each serving a group of query heads."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    kw = {"block_mask": block_mask, "return_lse": return_lse, "enable_gqa": enable_gqa}
    if not (q.device.type == "cuda" if compiled is None else compiled):
        return flex_attention(q, k, v, **kw)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, **kw)


def attention_with_sinks(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, sinks: Tensor) -> Tensor:
    """Exact softmax attention of ``q`` (batch, heads, c, d) over ``k, v`` (batch, heads, n, d) where ``keep``
    (broadcastable to (batch, heads, c, n), bool) allows, with one sink logit per head (``sinks`` (heads,)) joined
    to every row's softmax and dropped from the output: transformers' eager gpt-oss formula, explicit (the
    ``c x n`` scores are materialised: the CPU / exact path). Gradients reach ``sinks``."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _sinks_from_lse(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention ``out`` (batch, heads, c, d) with its row log-sum-exps ``lse`` (batch, heads, c) -> the same with a
    sink column per head: the rows' mass shrinks by ``e^lse / (e^lse + e^sink) = sigmoid(lse - sink)``."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    scale = torch.sigmoid(lse.to(dtype) - sinks.to(dtype).view(1, -1, 1))
    return out * scale.unsqueeze(-1).to(out.dtype)


@dataclass(eq=False)
class DocumentMask:
    """The block-causal mask of one (micro)batch forward: ``starts`` (batch, s) the document start of each local
    token, ``positions`` (s,) the window positions of the local tokens (global ones under context parallelism).
    Built by the decoder's forward and handed to every block (``mask`` keyword); each attention seam calls
    :meth:`attend`. What a backend builds from it (a boolean mask, a ``BlockMask``) is built here, at construction,
    outside the compiled blocks, once per forward, and reused by every layer and by the recomputation of activation
    checkpointing. ``windows``: the sliding windows (None: full attention) of the seams it serves, each built;
    ``documents`` False: a plain causal mask (every start 0, :meth:`causal`) for a model whose seams need a mask
    without documents (a window, sinks)."""

    starts: Tensor
    positions: Tensor
    backend: str = ""  # "" = attention_backend(device)
    windows: tuple = (None,)
    documents: bool = True
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def causal(cls, batch: int, positions: Tensor, windows: tuple = (None,), backend: str = "") -> DocumentMask:
        """The causal mask (no documents) of ``batch`` rows at ``positions``, for seams with a window or sinks."""
        starts = torch.zeros(batch, positions.shape[0], dtype=torch.int64, device=positions.device)
        return cls(starts, positions, backend=backend, windows=tuple(windows), documents=False)

    def __post_init__(self):
        if self.starts.dim() != 2 or self.starts.shape[1] != self.positions.shape[0]:
            raise ValueError(
                f"document_starts must be (batch, seq) matching the {self.positions.shape[0]} local tokens, got "
                f"shape {tuple(self.starts.shape)}"
            )
        if not self.backend:
            self.backend = attention_backend(self.starts.device)
        # a pipeline stage's shape inference runs on meta, the planner's probe on fake tensors: built lazily there
        if self.starts.device.type != "meta" and not _is_fake(self.starts):
            self._build()

    def _build(self) -> None:
        """Build the mask of every contiguous run of positions against the keys it can see (:func:`window_keys`),
        for every window, here, outside the (possibly compiled) blocks: the whole local sequence on one device, each
        of the two chunks under context parallelism (``rows``, the keys as ``attend`` is called)."""
        pos = self.positions.tolist()
        cuts = [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
        for lo, hi in zip([0, *cuts], [*cuts, len(pos)]):
            for window in self.windows:
                k0, k1 = window_keys(pos[lo], pos[hi - 1], window)
                self._mask_for(lo, hi, k1 - k0, self.starts.shape[0], self.starts.device, window, k0)

    def _mask_for(self, lo: int, hi: int, n: int, batch: int, device, window: int | None = None, key_start: int = 0):
        key = (self.backend, lo, hi, n, batch, window, key_start)
        if key not in self._cache:
            if self.backend == "flex":
                self._cache[key] = self._block_mask(lo, hi, n, batch, device, window, key_start)
            else:
                self._cache[key] = self.dense(lo, hi, n, window, key_start)
        return self._cache[key]

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rows: tuple[int, int] | None = None,
        *,
        window: int | None = None,
        sinks: Tensor | None = None,
        key_start: int = 0,
    ) -> Tensor:
        """Block-causal attention of ``q`` (batch, heads, c, d), the local tokens ``rows`` (``[lo, hi)``, default
        all), over ``k, v`` (batch, heads or kv heads, n, d: grouped-query heads are read in place), the keys at
        window positions ``key_start .. key_start + n - 1``;
        ``window``: a sliding window (None: full); ``sinks`` (heads,): one sink logit per head."""
        lo, hi = rows if rows is not None else (0, self.positions.shape[0])
        mask = self._mask_for(lo, hi, k.shape[2], q.shape[0], q.device, window, key_start)
        gqa = q.shape[1] != k.shape[1]  # grouped-query heads: k, v read in place by SDPA / FlexAttention
        if self.backend == "flex":
            if sinks is None:
                return _flex(q, k, v, mask, enable_gqa=gqa)
            out, lse = _flex(q, k, v, mask, return_lse=True, enable_gqa=gqa)
            return _sinks_from_lse(out, lse, sinks)
        if sinks is not None:
            # The explicit path materialises the (c x n) scores of every query head, heads / kv_heads times the
            # size of the keys: repeating k and v to every head costs less than those, and keeps one matmul.
            if gqa:
                n_rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            return attention_with_sinks(q, k, v, mask, sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def dense(self, lo: int, hi: int, n: int, window: int | None = None, key_start: int = 0) -> Tensor:
        """(batch, 1, hi - lo, n) bool: query row ``i`` sees key ``j`` (at position ``key_start + j``) iff
        ``start[i] <= j <= position[i]`` (and ``j > position[i] - window`` under a sliding window)."""
        kv = torch.arange(key_start, key_start + n, device=self.starts.device)
        starts = self.starts[:, lo:hi, None]
        pos = self.positions[lo:hi, None]
        keep = (kv >= starts) & (kv <= pos)
        if window is not None:
            keep = keep & (kv > pos - window)
        return keep.unsqueeze(1)

    def _block_mask(self, lo: int, hi: int, n: int, batch: int, device, window: int | None, key_start: int):
        from torch.nn.attention.flex_attention import create_block_mask

        starts = self.starts[:, lo:hi].contiguous()
        pos = self.positions[lo:hi].contiguous()

        def document_causal(b, h, q_idx, kv_idx):
            kv = kv_idx + key_start
            return (kv >= starts[b, q_idx]) & (kv <= pos[q_idx])

        def document_window(b, h, q_idx, kv_idx):
            return document_causal(b, h, q_idx, kv_idx) & (kv_idx + key_start > pos[q_idx] - window)

        mask_mod = document_causal if window is None else document_window
        return create_block_mask(mask_mod, batch, None, hi - lo, n, device=device)
