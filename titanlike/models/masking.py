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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MASK_TYPES", "DocumentMask", "attention_backend", "document_starts"]

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


_compiled_flex = None


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":  # the eager reference (tests compare it with the SDPA path on CPU)
        return flex_attention(q, k, v, block_mask=block_mask)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask)


@dataclass(eq=False)
class DocumentMask:
    """The block-causal mask of one (micro)batch forward: ``starts`` (batch, s) the document start of each local
    token, ``positions`` (s,) the window positions of the local tokens (global ones under context parallelism).
    Built by the decoder's forward and handed to every block (``mask`` keyword); each attention seam calls
    :meth:`attend`. What a backend builds from it (a boolean mask, a ``BlockMask``) is built here, at construction,
    outside the compiled blocks, once per forward, and reused by every layer and by the recomputation of activation
    checkpointing."""

    starts: Tensor
    positions: Tensor
    backend: str = ""  # "" = attention_backend(device)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.starts.dim() != 2 or self.starts.shape[1] != self.positions.shape[0]:
            raise ValueError(
                f"document_starts must be (batch, seq) matching the {self.positions.shape[0]} local tokens, got "
                f"shape {tuple(self.starts.shape)}"
            )
        if not self.backend:
            self.backend = attention_backend(self.starts.device)
        if self.starts.device.type != "meta":  # (a pipeline stage's shape inference runs on meta: built lazily)
            self._build()

    def _build(self) -> None:
        """Build the mask of every contiguous run of positions against the keys before it, here, outside the
        (possibly compiled) blocks: the whole local sequence on one device, each of the two chunks under context
        parallelism (``rows``, ``n`` keys as ``attend`` is called)."""
        pos = self.positions.tolist()
        cuts = [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
        for lo, hi in zip([0, *cuts], [*cuts, len(pos)]):
            self._mask_for(lo, hi, pos[hi - 1] + 1, self.starts.shape[0], self.starts.device)

    def _mask_for(self, lo: int, hi: int, n: int, batch: int, device):
        key = (self.backend, lo, hi, n, batch)
        if key not in self._cache:
            if self.backend == "flex":
                self._cache[key] = self._block_mask(lo, hi, n, batch, device)
            else:
                self._cache[key] = self.dense(lo, hi, n)
        return self._cache[key]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: tuple[int, int] | None = None) -> Tensor:
        """Block-causal attention of ``q`` (batch, heads, c, d), the local tokens ``rows`` (``[lo, hi)``, default
        all), over ``k, v`` (batch, heads, n, d), the keys at window positions ``0 .. n-1``."""
        lo, hi = rows if rows is not None else (0, self.positions.shape[0])
        mask = self._mask_for(lo, hi, k.shape[2], q.shape[0], q.device)
        if self.backend == "flex":
            return _flex(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def dense(self, lo: int, hi: int, n: int) -> Tensor:
        """(batch, 1, hi - lo, n) bool: query row ``i`` sees key ``j`` iff ``start[i] <= j <= position[i]``."""
        kv = torch.arange(n, device=self.starts.device)
        starts = self.starts[:, lo:hi, None]
        pos = self.positions[lo:hi, None]
        return ((kv >= starts) & (kv <= pos)).unsqueeze(1)

    def _block_mask(self, lo: int, hi: int, n: int, batch: int, device):
        from torch.nn.attention.flex_attention import create_block_mask

        starts = self.starts[:, lo:hi].contiguous()
        pos = self.positions[lo:hi].contiguous()

        def document_causal(b, h, q_idx, kv_idx):
            return (kv_idx >= starts[b, q_idx]) & (kv_idx <= pos[q_idx])

        return create_block_mask(document_causal, batch, None, hi - lo, n, device=device)
