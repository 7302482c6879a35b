"""What document masking costs on a corpus: its document lengths and the share of attention the block-causal mask
keeps, as the data pipeline reports it (``scripts/mask_bench.py``; the planner's ``attention_fraction``).

Windows are cut from the flat token stream as the loaders cut them (window ``w`` holds tokens ``[w S, w S + S)``;
the label token is not attended), each document ended by the tokenizer's EOS. Two fractions, relative to the causal
mask of the same windows:

* ``pair_fraction``: (query, key) pairs the block-causal mask keeps, over the causal mask's ``S (S + 1) / 2``: the
  share of attention FLOPs an exact kernel computes (the rest is skipped);
* ``block_fraction``: ``block x block`` tiles with at least one kept pair, over the causal mask's tiles: the share
  FlexAttention's block-sparse kernel computes (it skips whole empty tiles only; ``block`` 128 is its default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DocumentStats", "document_stats"]


@dataclass(frozen=True)
class DocumentStats:
    documents: int  # EOS-ended documents in the stream (a trailing piece without EOS counts as one)
    mean_length: float  # tokens per document, EOS included
    median_length: float
    windows: int  # full windows of seq_len measured
    seq_len: int
    block: int
    pair_fraction: float  # kept (query, key) pairs / causal pairs
    block_fraction: float  # computed tiles / causal tiles

    def describe(self) -> str:
        return (
            f"{self.documents:,} documents (mean {self.mean_length:,.0f} tokens, median {self.median_length:,.0f}); "
            f"{self.windows:,} windows of {self.seq_len}: block_causal keeps {self.pair_fraction:.4f} of the causal "
            f"attention pairs, {self.block_fraction:.4f} of its {self.block}x{self.block} tiles"
        )


def document_stats(tokens, eos_id: int, seq_len: int, block: int = 128, max_windows: int | None = None):
    """:class:`DocumentStats` of the flat token stream ``tokens`` (array-like of ids) cut into ``seq_len`` windows
    (the first ``max_windows`` of them, default all)."""
    t = np.asarray(tokens)
    if seq_len < 1 or block < 1:
        raise ValueError(f"seq_len and block must be >= 1, got {seq_len}, {block}")
    n_windows = max(len(t) - 1, 0) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"{len(t)} tokens make no window of {seq_len} + 1")
    ends = np.flatnonzero(t == eos_id)
    bounds = np.concatenate([[-1], ends])
    if not len(ends) or ends[-1] != len(t) - 1:  # a trailing piece without EOS
        bounds = np.append(bounds, len(t) - 1)
    lengths = np.diff(bounds)
    n = n_windows * seq_len
    # each token's document start in the stream, then in its window (a window starting inside a document cuts it)
    begins = np.zeros(n, dtype=np.int64)
    inside = ends[ends < n - 1] + 1
    begins[inside] = inside
    doc_start = np.maximum.accumulate(begins)
    pos = np.arange(n)
    window_start = pos - pos % seq_len
    start = np.maximum(doc_start, window_start) - window_start  # (n,) in-window start of each query's document
    rel = pos - window_start
    pair_fraction = float((rel - start + 1).sum()) / (n_windows * seq_len * (seq_len + 1) / 2)
    nb = -(-seq_len // block)
    first_q = start.reshape(n_windows, seq_len)[:, ::block]  # in-window start of each query tile's first query
    qb = np.arange(nb)[None, :]
    tiles = (qb - first_q // block + 1).sum()  # query tile qb computes key tiles first_q // block .. qb
    block_fraction = float(tiles) / (n_windows * nb * (nb + 1) / 2)
    return DocumentStats(
        documents=len(lengths),
        mean_length=float(lengths.mean()) if len(lengths) else 0.0,
        median_length=float(np.median(lengths)) if len(lengths) else 0.0,
        windows=n_windows,
        seq_len=seq_len,
        block=block,
        pair_fraction=pair_fraction,
        block_fraction=block_fraction,
    )
