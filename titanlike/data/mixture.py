"""Weighted mixtures of sources: which source, and which of its samples, each global sample is.

A blend of n sources with weights w (normalized) is periodic with period P = 65,536 global samples: source i holds
c_i = round(w_i P) slots of every period (largest remainders, so that they sum to P; a weight that rounds to no slot
is refused), its k-th slot at the ideal time (k + 1/2) P / c_i, sorted (ties to the lower source): the sources
interleave as evenly as the counts allow, as Megatron's blended datasets do. Global sample g = pP + s is then the
``p c_i + rank(s)``-th sample of source ``i = source(s)``, and that source's own `PackedWindows` (its permutation
per epoch seeded by (seed, i, epoch)) maps it to a window. Everything is a pure function of (g, seed, weights):
the data-parallel layout, the workers and a resume never change it, and any global sample is found in O(1).

A source that runs out starts its next epoch (a new permutation): `samples_before` counts each source's samples
among the first g global samples, from which the trainer logs epochs and tokens per source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from titanlike.data.datasets import PackedWindows

PERIOD = 1 << 16


def blend_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """The slots of each source in one period (largest-remainder rounding of the normalized weights)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be positive finite numbers, got {list(weights)}")
    exact = w / w.sum() * period
    counts = np.floor(exact).astype(np.int64)
    short = period - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    if (counts == 0).any():
        i = int(np.argmin(counts))
        raise ValueError(
            f"weight {weights[i]} of source {i} is below 1/{period} of the total: it would never be drawn; raise it"
        )
    return counts


class Blend:
    """The periodic, evenly interleaved assignment of global samples to sources."""

    def __init__(self, weights: Sequence[float], period: int = PERIOD):
        self.period = period
        self.counts = blend_counts(weights, period)
        src = np.repeat(np.arange(len(self.counts)), self.counts)
        rank = np.concatenate([np.arange(c) for c in self.counts])
        times = (rank + 0.5) / self.counts[src]
        order = np.lexsort((src, times))
        self.slot_source = src[order].astype(np.int64)
        self.slot_rank = rank[order].astype(np.int64)

    @property
    def n_sources(self) -> int:
        return len(self.counts)

    def locate(self, global_samples: Iterable[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sample index) of each global sample."""
        g = np.asarray(global_samples if isinstance(global_samples, np.ndarray) else list(global_samples), np.int64)
        if len(g) and g.min() < 0:
            raise IndexError(f"global sample indices must be >= 0, got {g.min()}")
        p, s = np.divmod(g, self.period)
        src = self.slot_source[s]
        return src, p * self.counts[src] + self.slot_rank[s]

    def samples_before(self, g: int) -> np.ndarray:
        """How many of the global samples [0, g) each source holds."""
        p, s = divmod(int(g), self.period)
        return p * self.counts + np.bincount(self.slot_source[:s], minlength=self.n_sources)


class BlendedWindows:
    """The global sample stream of a weighted mixture: the interface of `PackedWindows` the loader uses
    (``seq_len``, ``batch``). Picklable for loader workers (each source's tokens travel by reference)."""

    def __init__(self, sources: Sequence[PackedWindows], weights: Sequence[float]):
        if len(sources) != len(weights) or len(sources) < 2:
            raise ValueError(f"a mixture needs >= 2 sources and one weight each, got {len(sources)} / {len(weights)}")
        lens = {w.seq_len for w in sources}
        if len(lens) != 1:
            raise ValueError(f"every source of a mixture needs the same seq_len, got {sorted(lens)}")
        self.sources = list(sources)
        self.seq_len = lens.pop()
        self.blend = Blend(weights)

    def batch(self, global_samples: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked (inputs, labels) of the given global samples, each LongTensor[n, seq_len], in their order."""
        src, local = self.blend.locate(global_samples)
        inputs = torch.empty((len(src), self.seq_len), dtype=torch.int64)
        labels = torch.empty_like(inputs)
        for i in np.unique(src):
            sel = np.flatnonzero(src == i)
            w = self.sources[i]
            x, y = w.batch_windows(w.window_indices(local[sel]))
            inputs[torch.from_numpy(sel)], labels[torch.from_numpy(sel)] = x, y
        return inputs, labels

    def samples_before(self, g: int) -> np.ndarray:
        return self.blend.samples_before(g)
