"""The training data of a run: its sources, their validation data, the global sample stream, what was read.

``data.path`` is one entry or a list of entries (each a file, a folder or a glob, formats.py). Without
``data.weights`` the entries are laid end to end into one stream (what a folder is), with weights (one per entry)
each entry is a source of a weighted mixture (mixture.py). Validation reads ``validation.path`` when it is set (one
stream, or with a mixture one entry per source), else each source's held-out tail of ``data.val_fraction``.

`build_corpus` checks everything first — the weights, every file of every entry (check.py), then each source's
length — and raises one ValueError listing every problem; only then does it tokenize text and index shards.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from titanlike.data.check import check_length, check_sources
from titanlike.data.datasets import PackedWindows, open_tokens, split_stream
from titanlike.data.formats import SUFFIXES
from titanlike.data.mixture import Blend, BlendedWindows, blend_counts
from titanlike.data.shards import TokenShards


def entries(value: str | Sequence[str]) -> list[str]:
    """``data.path`` / ``validation.path`` as a list of entries ('' and [] are no entries)."""
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)] if os.fspath(value) else []
    return [os.fspath(v) for v in value]


def source_name(entry: str) -> str:
    """A short name for a mixture source: its file's or folder's name without data suffixes or glob parts."""
    parts = [p for p in Path(entry).parts if p not in ("/", "")]
    while parts and re.search(r"[*?\[]", parts[-1]):
        parts.pop()  # 'c4/*.json.gz' -> 'c4'
    name = parts[-1] if parts else "data"
    for ending in SUFFIXES:
        if name.lower().endswith(ending):
            name = name[: -len(ending)]
            break
    return re.sub(r"[^\w.-]+", "_", name) or "data"


@dataclass
class Source:
    """One stream of the run: its name, the entries it reads, its training tokens and its validation tokens."""

    name: str
    entries: list[str]
    train: TokenShards
    val: TokenShards | None = None
    n_windows: int = 0  # training windows of seq_len + 1 (set by build_corpus)


@dataclass
class Corpus:
    sources: list[Source]
    weights: list[float] | None  # None: one stream (a single source)
    validation: list[tuple[str, TokenShards]] = field(default_factory=list)  # (name, tokens) per validation stream
    seq_len: int = 0

    @property
    def is_mixture(self) -> bool:
        return self.weights is not None

    def windows(self, seed: int, shuffle: bool = True) -> PackedWindows | BlendedWindows:
        """The global sample stream: one source's `PackedWindows`, or the weighted blend of every source's."""
        if not self.is_mixture:
            return PackedWindows(self.sources[0].train, self.seq_len, seed=seed, shuffle=shuffle)
        return BlendedWindows(
            [
                PackedWindows(s.train, self.seq_len, seed=seed, shuffle=shuffle, stream=i)
                for i, s in enumerate(self.sources)
            ],
            self.weights,
        )

    def samples_before(self, global_sample: int) -> list[int]:
        """Each source's samples among the global samples [0, global_sample)."""
        if not self.is_mixture:
            return [int(global_sample)]
        return [int(c) for c in self._blend.samples_before(global_sample)]

    def epochs(self, global_sample: int) -> list[int]:
        """The epoch each source is in once the global samples [0, global_sample) are read (0 = the first)."""
        return [n // s.n_windows for n, s in zip(self.samples_before(global_sample), self.sources)]

    def seen(self, global_sample: int) -> dict[str, tuple[int, float]]:
        """Source name -> (tokens trained on, epochs read) after the global samples [0, global_sample)."""
        return {
            s.name: (n * self.seq_len, n / s.n_windows)
            for n, s in zip(self.samples_before(global_sample), self.sources)
        }

    @property
    def _blend(self) -> Blend:
        if not hasattr(self, "_blend_cache"):
            self._blend_cache = Blend(self.weights)
        return self._blend_cache

    def describe(self) -> str:
        """One line: the sources, their sizes and weights, and the validation streams."""
        parts = []
        for i, s in enumerate(self.sources):
            w = f" weight {self.weights[i]:g}" if self.is_mixture else ""
            shards = f", {s.train.n_shards} shard(s)" if s.train.n_shards else ""
            parts.append(f"{s.name}{w}: {len(s.train):,} tokens{shards}")
        val = ", ".join(f"{n or 'held-out tail'} {len(t):,}" for n, t in self.validation)
        return "; ".join(parts) + (f"; validation: {val} tokens" if val else "")


def _weights_problems(paths: list[str], weights: Sequence[float]) -> list[str]:
    problems = []
    if len(weights) != len(paths):
        problems.append(
            f"data.weights has {len(weights)} weight(s) for {len(paths)} data.path "
            f"entr{'y' if len(paths) == 1 else 'ies'}; give one weight per entry (or no weights: the entries are "
            f"then one stream)"
        )
    bad = [w for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)]
    if bad:
        problems.append(f"data.weights must be positive numbers, got {', '.join(repr(w) for w in bad)}")
    if len(paths) == 1 and weights and not problems:
        problems.append("data.weights needs two or more data.path entries to mix; drop it for one source")
    if not problems:
        try:
            blend_counts(weights)
        except ValueError as e:
            problems.append(f"data.weights: {e}")
    return problems


def build_corpus(
    path: str | Sequence[str],
    tokenizer,
    *,
    seq_len: int,
    weights: Sequence[float] = (),
    validation_path: str | Sequence[str] = "",
    val_fraction: float = 0.0,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
    default: Sequence[str] = (),
) -> Corpus:
    """Check, then open, the sources of a run (see the module doc); one ValueError line lists every problem.

    ``default``: the entries used when ``path`` is empty (the shipped corpus)."""
    paths = entries(path) or list(default)
    val_paths = entries(validation_path)
    weights = list(weights)
    where = "data.path"
    problems = _weights_problems(paths, weights) if weights else []
    problems += check_sources(paths, tokenizer, text_field, encoding, errors)
    if val_paths:
        problems += [f"validation.path: {p}" for p in check_sources(val_paths, tokenizer, text_field, encoding, errors)]
    if problems:
        raise ValueError(
            f"data.path: {len(problems)} bad input{'s' if len(problems) > 1 else ''}: " + "; ".join(problems)
        )

    mixture = bool(weights)
    groups = [[p] for p in paths] if mixture else [paths]
    names = [source_name(g[0]) for g in groups] if mixture else ["corpus"]
    names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    per_source_val = mixture and len(val_paths) == len(paths) and len(paths) > 1
    sources = []
    for name, group in zip(names, groups):
        tokens = open_tokens(group, tokenizer, text_field, encoding, errors)
        train, val = (tokens, None) if val_paths else split_stream(tokens, val_fraction)
        sources.append(Source(name, group, train, val if val is not None and len(val) else None))
    for s in sources:
        label = f"{where} '{s.entries[0]}'" if mixture else (f"{where} '{path}'" if entries(path) else "the corpus")
        why = check_length(len(s.train), seq_len, label)
        if why:
            problems.append(why)
        s.n_windows = (len(s.train) - 1) // seq_len
    if problems:
        raise ValueError("; ".join(problems))

    if val_paths and per_source_val:
        validation = [
            (s.name, open_tokens([v], tokenizer, text_field, encoding, errors)) for s, v in zip(sources, val_paths)
        ]
    elif val_paths:
        validation = [("validation", open_tokens(val_paths, tokenizer, text_field, encoding, errors))]
    else:
        validation = [(s.name if mixture else "", s.val) for s in sources if s.val is not None]
    return Corpus(sources, [float(w) for w in weights] if mixture else None, validation, seq_len)
