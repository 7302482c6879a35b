"""Token streams and packed training windows.

Every source becomes one flat token stream: documents, each followed by the tokenizer's EOS, laid end to end.
Sources are data files of the formats in formats.py (plain text, JSON lines plain / gzip / zstandard, parquet; a
file, a folder of them or a glob) and pre-tokenized ``.bin`` shards (shards.py). `open_tokens` returns the stream as
a `TokenShards`: .bin shards indexed, never read into memory, text tokenized into arrays, nothing concatenated.

`PackedWindows` cuts a stream into windows of seq_len + 1 tokens with stride seq_len, and fixes
the order in which they are read as a pure function of (global sample index, seed): global sample
g lies in epoch g // n_windows and is window perm(seed, epoch)[g % n_windows]. Nothing here knows
about data-parallel ranks; the loader only decides which global samples a rank reads.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from titanlike.data.formats import expand_paths, file_kind, iter_documents
from titanlike.data.shards import (
    TokenShards,
    gather_rows,
    index_token_file,
    open_token_file,
    sidecar_path,
    token_dtype,
    write_token_file,
)
from titanlike.data.shuffle import index_shuffle

_BATCH_CHARS = 32 << 20  # tokenize documents in batches of about this many characters
# Up to this many windows a source's order per epoch is numpy's permutation array (8 bytes per window); beyond it the
# index shuffle, computed per sample in O(1) memory (shuffle.py), so that memory does not grow with the corpus.
ARRAY_ORDER_MAX_WINDOWS = 1 << 20

__all__ = [
    "PackedWindows",
    "iter_token_chunks",
    "load_token_stream",
    "open_token_file",
    "open_tokens",
    "sidecar_path",
    "split_stream",
    "token_dtype",
    "write_token_file",
]


# ---------------------------------------------------------------------------------------------
# Sources -> token stream


def _text_chunks(files: Iterable[Path], tokenizer, text_field: str, encoding: str, errors: str) -> Iterator[np.ndarray]:
    """The tokens of the documents of `files` (no .bin among them), in batches of about _BATCH_CHARS characters."""
    dtype = token_dtype(tokenizer.vocab_size)
    pending: list[str] = []
    pending_chars = 0

    def flush() -> Iterator[np.ndarray]:
        nonlocal pending_chars
        if pending:
            ids = tokenizer.encode_batch(pending, eos=True)
            pending.clear()
            pending_chars = 0
            yield np.concatenate([np.asarray(doc, dtype=dtype) for doc in ids])

    for path in files:
        for doc in iter_documents(path, text_field, encoding, errors):
            if doc:
                pending.append(doc)
                pending_chars += len(doc)
                if pending_chars >= _BATCH_CHARS:
                    yield from flush()
    yield from flush()


def _runs(files: list[Path]) -> Iterator[tuple[bool, list[Path]]]:
    """Consecutive files grouped into (is_bin, run): the documents of a text run are tokenized together, in order."""
    for is_bin, run in itertools.groupby(files, key=lambda f: file_kind(f)[0] == "bin"):
        yield is_bin, list(run)


def _pieces(paths, tokenizer, text_field: str, encoding: str, errors: str, shard) -> Iterator:
    """The stream of `paths` in order: ``shard(path, tokenizer)`` for each .bin, token chunks of the text between."""
    for is_bin, run in _runs(expand_paths(paths)):
        if is_bin:
            yield from (shard(f, tokenizer) for f in run)
        else:
            yield from _text_chunks(run, tokenizer, text_field, encoding, errors)


def iter_token_chunks(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> Iterator[np.ndarray]:
    """The token stream of `paths`, in order, as consecutive chunks (memory-mapped for .bin files).

    Text and JSON lines are decoded with `encoding` and the `errors` policy ('strict', 'replace', 'ignore').

    Each non-empty document contributes its tokens followed by ``tokenizer.eos_id``; empty
    documents contribute nothing.
    """
    return _pieces(paths, tokenizer, text_field, encoding, errors, open_token_file)


def open_tokens(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> TokenShards:
    """The token stream of `paths` (files, folders, globs) as a `TokenShards`: .bin shards indexed (checked against
    `tokenizer`, never read), text tokenized into in-memory pieces, nothing concatenated."""
    tokens = TokenShards(
        list(_pieces(paths, tokenizer, text_field, encoding, errors, index_token_file)), tokenizer.vocab_size
    )
    if not len(tokens):
        raise ValueError(f"data path {paths} holds no text; point it at non-empty documents")
    return tokens


def load_token_stream(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> np.ndarray:
    """All documents of `path` (one source or a list of them) as one flat token array, in memory.

    The dtype is uint16 for vocabularies up to 65,536 ids, else uint32. A single .bin source is
    returned as a read-only np.memmap. For small data and tools: the trainer reads through `open_tokens`,
    which never concatenates (several .bin shards are concatenated into memory here).
    """
    chunks = [c for c in iter_token_chunks(path, tokenizer, text_field, encoding, errors) if len(c)]
    if not chunks:
        raise ValueError(f"data path {path} holds no text; point it at non-empty documents")
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


# ---------------------------------------------------------------------------------------------
# Splitting and packing


def split_stream(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) views of `tokens`: validation is the last floor(len * val_fraction) tokens."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]


class PackedWindows(torch.utils.data.Dataset):
    """Windows of seq_len + 1 tokens at stride seq_len; inputs = w[:-1], labels = w[1:].

    ``windows[i]`` is window i in storage order. The training order is global: `window_index(g)`
    maps a global sample index g (0, 1, 2, ... forever) to a window, epoch by epoch, through a
    permutation seeded by (seed, epoch) (a source of a mixture: (seed, stream, epoch)) when `shuffle` is set:
    numpy's permutation array up to ARRAY_ORDER_MAX_WINDOWS windows, the O(1)-memory index shuffle beyond. It never
    depends on how many ranks or workers read the samples.
    """

    def __init__(
        self, tokens: np.ndarray | TokenShards, seq_len: int, seed: int = 0, shuffle: bool = True, stream: int = -1
    ):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a flat 1-D array, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = int(seed)
        self.shuffle = shuffle
        self.stream = int(stream)  # a source of a mixture: its own permutations, rng([seed, stream, epoch])
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of seq_len + 1 = {seq_len + 1} tokens; "
                f"use more data or a shorter seq_len"
            )
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n_windows:
            raise IndexError(f"window {i} out of range [0, {self.n_windows})")
        inputs, labels = self.batch_windows(np.array([i]))
        return inputs[0], labels[0]

    def _key(self, epoch: int) -> list[int]:
        return [self.seed, epoch] if self.stream < 0 else [self.seed, self.stream, epoch]

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of `epoch` (identity when not shuffling), as a whole array."""
        if not self.shuffle:
            return np.arange(self.n_windows)
        if self.n_windows > ARRAY_ORDER_MAX_WINDOWS:
            return index_shuffle(np.arange(self.n_windows), self.n_windows, self._key(epoch))
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch rarely spans more than two epochs; keep the cache small
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng(self._key(epoch)).permutation(self.n_windows)
        return self._perms[epoch]

    def _order(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The windows at ``positions`` of `epoch`'s order: numpy's permutation array up to ARRAY_ORDER_MAX_WINDOWS
        windows, beyond it the index shuffle (O(1) memory, shuffle.py)."""
        if self.n_windows > ARRAY_ORDER_MAX_WINDOWS:
            return index_shuffle(positions, self.n_windows, self._key(epoch))
        return self.permutation(epoch)[positions]

    def window_indices(self, global_samples: Iterable[int]) -> np.ndarray:
        """The windows read as the given global samples."""
        g = np.fromiter(global_samples, dtype=np.int64)
        if (g < 0).any():
            raise IndexError(f"global sample indices must be >= 0, got {g.min()}")
        epoch, i = np.divmod(g, self.n_windows)
        if not self.shuffle:
            return i
        out = np.empty_like(i)
        for e in np.unique(epoch):
            in_e = epoch == e
            out[in_e] = self._order(int(e), i[in_e])
        return out

    def window_index(self, g: int) -> int:
        """The window read as global sample `g`."""
        return int(self.window_indices([g])[0])

    def sample(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of global sample `g`."""
        return self[self.window_index(g)]

    def batch(self, global_samples: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked (inputs, labels) of the given global samples, each LongTensor[n, seq_len]."""
        return self.batch_windows(self.window_indices(global_samples))

    def batch_windows(self, window_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = gather_rows(self.tokens, np.asarray(window_ids, dtype=np.int64) * self.seq_len, self.seq_len + 1)
        w = torch.from_numpy(rows.astype(np.int64))
        return w[:, :-1], w[:, 1:]

    # A token array memory-mapped from a .bin travels to DataLoader workers as (file, offset,
    # length), not as a pickled copy of its contents.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_perms"] = {}
        ref = _memmap_reference(self.tokens)
        if ref is not None:
            state["tokens"] = ref
        return state

    def __setstate__(self, state: dict) -> None:
        ref = state["tokens"]
        if isinstance(ref, tuple):
            filename, dtype, offset, length = ref
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


def _memmap_reference(a: np.ndarray) -> tuple[str, str, int, int] | None:
    """(file, dtype, byte offset, length) if `a` is a contiguous, non-empty 1-D view of a file mapping."""
    if not isinstance(a, np.ndarray):
        return None  # a TokenShards pickles its shards by path itself
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not (isinstance(root, np.memmap) and root.filename and a.ndim == 1 and len(a) and a.flags.c_contiguous):
        return None
    offset = root.offset + (a.__array_interface__["data"][0] - root.__array_interface__["data"][0])
    return root.filename, a.dtype.str, offset, len(a)
