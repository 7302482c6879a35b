"""Many .bin shards, never in memory: a stream of shards and text pieces reads exactly as their concatenation
(windows across shard boundaries, views, loader workers), indexing reads a bounded sample of each shard (not the
shard), at most 64 files are open at once, and a version-1 sidecar (no min/max ids) is verified by one full scan."""

from __future__ import annotations

import itertools
import json
import os
import pickle

import numpy as np
import pytest

from titanlike.data import (
    PackedWindows,
    TokenShards,
    build_dataloader,
    build_tokenizer,
    index_token_file,
    load_token_stream,
    open_tokens,
    sidecar_path,
    write_token_file,
)
from titanlike.data import shards as shards_module


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("test")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    """A folder of 100 shards of uneven sizes (some shorter than a window), a text file and one more shard."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    folder = root / "shards"
    for i in range(100):
        n = int(rng.integers(1, 300)) if i % 10 else 5
        write_token_file([rng.integers(0, tok.vocab_size, n, dtype=np.uint16)], folder / f"s{i:03d}.bin", tok)
    (root / "b.txt").write_text("Some text between the shards. " * 20)
    write_token_file([rng.integers(0, tok.vocab_size, 777, dtype=np.uint16)], root / "c.bin", tok)
    paths = [str(folder), str(root / "b.txt"), str(root / "c.bin")]
    return paths, load_token_stream(paths, tok)  # the old way: everything concatenated in memory


def test_shards_read_exactly_as_their_concatenation(corpus, tok):
    paths, flat = corpus
    ts = open_tokens(paths, tok)
    assert isinstance(ts, TokenShards) and ts.n_shards == 101 and len(ts) == len(flat)
    assert np.array_equal(ts.read(), flat)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(flat) - 65, 500)
    assert np.array_equal(ts.gather(starts, 65), flat[starts[:, None] + np.arange(65)])
    view = ts[1000:-1000][10:5000]
    assert len(view) == 4990 and np.array_equal(view.read(), flat[1010:6000])
    assert np.array_equal(view.gather(np.array([0, 4000]), 990), np.stack([flat[1010:2000], flat[5010:6000]]))
    assert len(ts._fds) <= 64  # least recently used files closed (descriptors, not mappings)
    with pytest.raises(IndexError):
        view.gather(np.array([4000]), 991)


def test_windows_and_loader_workers_over_shards_equal_the_in_memory_stream(corpus, tok):
    paths, flat = corpus
    ts = open_tokens(paths, tok)
    a, b = PackedWindows(ts, 32, seed=5), PackedWindows(flat, 32, seed=5)
    for x, y in zip(a.batch(range(700, 764)), b.batch(range(700, 764))):
        assert x.equal(y)
    assert len(pickle.dumps(a)) < 50_000  # the index and paths travel to workers, not the tokens
    kw = dict(seq_len=32, global_batch_size=8, local_batch_size=4, dp_rank=1, dp_degree=2, seed=5)
    ref = build_dataloader(flat, **kw)
    two = build_dataloader(ts, num_workers=2, **kw)
    for (x, y), (u, v) in itertools.islice(zip(ref, two), 6):
        assert x.equal(u) and y.equal(v)


def test_indexing_reads_a_bounded_sample_not_the_shard(tmp_path, tok, monkeypatch):
    big = tmp_path / "big.bin"
    write_token_file([np.arange(1_000_000, dtype=np.uint16) % 2000], big, tok)
    read = []
    real = os.pread
    monkeypatch.setattr(shards_module.os, "pread", lambda fd, n, off: read.append(n) or real(fd, n, off))
    info = index_token_file(big, tok)
    assert (info.n_tokens, info.min_id, info.max_id) == (1_000_000, 0, 1999)
    assert sum(read) <= shards_module.SAMPLE_BLOCKS * shards_module.SAMPLE_BLOCK_TOKENS * 2  # 64 KiB of 2 MB
    # a version-1 sidecar (no min/max to verify) is checked by one full scan, in bounded chunks
    meta = json.loads(sidecar_path(big).read_text())
    v1 = {k: v for k, v in meta.items() if k not in ("min_id", "max_id")} | {"version": 1}
    sidecar_path(big).write_text(json.dumps(v1))
    read.clear()
    assert index_token_file(big, tok).max_id == 1999 and sum(read) == 2_000_000
    raw = np.fromfile(big, dtype=np.uint16)
    raw[123_456] = 4000
    raw.tofile(big)
    with pytest.raises(ValueError, match="holds token id 4000 but the vocabulary of 'test' has 2008 ids"):
        index_token_file(big, tok)


def test_text_pieces_are_not_concatenated(tmp_path, tok, monkeypatch):
    import titanlike.data.datasets as ds

    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 200)
    monkeypatch.setattr(ds, "_BATCH_CHARS", 100)  # a piece per document
    ts = open_tokens(tmp_path, tok)
    assert len(ts.pieces) == 3 and ts.n_shards == 0
    assert np.array_equal(ts.read(), load_token_stream(tmp_path, tok))


def test_beyond_a_million_windows_the_order_takes_no_memory(monkeypatch):
    """Above ARRAY_ORDER_MAX_WINDOWS a source's order is the index shuffle (a keyed Feistel permutation computed per
    sample): still a permutation per epoch, a pure function of (seed, stream, epoch, index), no array kept."""
    import titanlike.data.datasets as ds
    from titanlike.data.shuffle import index_shuffle

    for n in (1, 2, 3, 97, 4096, 5000):
        assert sorted(index_shuffle(np.arange(n), n, [3, 1]).tolist()) == list(range(n))
    monkeypatch.setattr(ds, "ARRAY_ORDER_MAX_WINDOWS", 50)
    tokens = np.arange(4 * 97 + 1, dtype=np.uint16)
    w = PackedWindows(tokens, 4, seed=3)
    order = w.window_indices(range(3 * 97))
    epochs = [order[e * 97 : (e + 1) * 97] for e in range(3)]
    assert all(sorted(e.tolist()) == list(range(97)) for e in epochs) and not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(97)) and w._perms == {}
    assert np.array_equal(PackedWindows(tokens, 4, seed=3).window_indices(range(250, 10, -1)), order[250:10:-1])
    other = PackedWindows(tokens, 4, seed=3, stream=1).window_indices(range(97))
    assert not np.array_equal(other, epochs[0]) and np.array_equal(w.permutation(1), epochs[1])
