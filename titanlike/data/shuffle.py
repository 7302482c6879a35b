"""A random permutation of [0, n) evaluated at any index, in O(1) memory: a keyed Feistel network with cycle walking.

``index_shuffle(i, n, key)`` is the position-i element of a permutation of [0, n) fixed by ``key`` (any sequence of
non-negative integers, as numpy's ``default_rng`` takes): a balanced Feistel network of ``ROUNDS`` rounds on
``2b``-bit words (``2^2b >= n``), whose round function is the splitmix64 finalizer of the half-word mixed with a
round key drawn from ``default_rng(key)``, and cycle walking (apply it again until the value is below n), which keeps
it a bijection of [0, n). It is what Grain's ``index_shuffle`` does. `PackedWindows` uses it for sources of more than
``ARRAY_ORDER_MAX_WINDOWS`` windows, where numpy's permutation array (8 bytes per window, per epoch) would grow with
the corpus: 1T tokens at seq_len 2048 are 488M windows, 3.9 GB per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROUNDS = 8
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right


def index_shuffle(i: np.ndarray | Sequence[int], n: int, key: Sequence[int]) -> np.ndarray:
    """The elements at positions ``i`` of the permutation of [0, n) keyed by ``key`` (int64 array)."""
    i = np.asarray(i, dtype=np.int64)
    if n < 1 or (len(i) and (i.min() < 0 or i.max() >= n)):
        raise IndexError(f"positions must lie in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = np.random.default_rng(list(key)).integers(0, 2**63, ROUNDS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        out = _feistel(i.astype(np.uint64), half, keys)
        walk = out >= np.uint64(n)
        while walk.any():
            out[walk] = _feistel(out[walk], half, keys)
            walk = out >= np.uint64(n)
    return out.astype(np.int64)
