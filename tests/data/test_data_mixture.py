"""Weighted mixtures: each global sample's source and position are a pure function of (sample index, seed,
weights); the sources interleave within one sample of their share at every point; the loader's batches are the
same under every data-parallel layout and after a resume; a source that runs out starts a new epoch (its own
permutation) and the counts per source say so; bad weights and validation lists are refused in one line."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from titanlike.data import Blend, BlendedWindows, PackedWindows, build_corpus, build_dataloader, build_tokenizer
from titanlike.data.corpus import source_name
from titanlike.data.mixture import PERIOD, blend_counts

SEQ = 4
SOURCES = [np.arange(n * SEQ + 1, dtype=np.uint16) + 10_000 * k for k, n in enumerate((23, 7, 50))]  # ids tell
WEIGHTS = [0.5, 0.3, 0.2]


def mixture(seed=7) -> BlendedWindows:
    return BlendedWindows([PackedWindows(t, SEQ, seed=seed, stream=i) for i, t in enumerate(SOURCES)], WEIGHTS)


def test_counts_and_the_interleave():
    for weights in (WEIGHTS, [1, 1], [0.9, 0.05, 0.05], [3, 1, 1, 1, 0.01]):
        b = Blend(weights)
        assert b.counts.sum() == PERIOD and np.abs(b.counts - np.array(weights) / sum(weights) * PERIOD).max() <= 1
        onehot = np.zeros((PERIOD, len(weights)))
        onehot[np.arange(PERIOD), b.slot_source] = 1
        seen = onehot.cumsum(0)
        ideal = np.arange(1, PERIOD + 1)[:, None] * b.counts / PERIOD
        assert np.abs(seen - ideal).max() < 1.0, weights  # within one sample of its share at every point
    with pytest.raises(ValueError, match="positive finite"):
        blend_counts([1, -1])
    with pytest.raises(ValueError, match="below 1/65536 of the total: it would never be drawn"):
        blend_counts([1, 1e-9])


def test_a_global_sample_is_a_pure_function_of_its_index():
    b = Blend(WEIGHTS)
    g = np.array([0, 1, 5, PERIOD - 1, PERIOD, 3 * PERIOD + 17, 10**12 + 3])
    src, local = b.locate(g)
    again = [b.locate([x]) for x in reversed(g)]
    assert [int(s[0]) for s, _ in again][::-1] == src.tolist() and [int(l[0]) for _, l in again][::-1] == local.tolist()
    # each source's samples are numbered 0, 1, 2, ... in global order, and samples_before counts them
    s, l = b.locate(np.arange(3 * PERIOD + 100))
    for i in range(3):
        assert np.array_equal(l[s == i], np.arange((s == i).sum()))
    for n in (0, 1, 999, PERIOD, 2 * PERIOD + 5):
        assert b.samples_before(n).tolist() == np.bincount(s[:n], minlength=3).tolist()


def test_batches_come_from_each_sources_own_order():
    m = mixture()
    g = np.arange(200)
    x, y = m.batch(g)
    src, local = m.blend.locate(g)
    for i in range(3):
        w = PackedWindows(SOURCES[i], SEQ, seed=7, stream=i)
        sel = src == i
        assert np.array_equal(x[sel].numpy(), w.batch(local[sel])[0].numpy())
        assert (x[sel] // 10_000 == i).all() and (y[sel] == x[sel] + 1).all()
    # the 7-window source wraps: every epoch a new permutation of its windows, and never one silently repeated
    w1 = PackedWindows(SOURCES[1], SEQ, seed=7, stream=1)
    firsts = [w1.window_indices(range(e * 7, (e + 1) * 7)).tolist() for e in range(3)]
    assert all(sorted(f) == list(range(7)) for f in firsts) and firsts[0] != firsts[1]
    assert not np.array_equal(w1.permutation(0), PackedWindows(SOURCES[1], SEQ, seed=7, stream=2).permutation(0))


def step_windows(dp_degree, local_batch_size, n_steps, start_sample=0, num_workers=0):
    accum = 8 // (dp_degree * local_batch_size)
    per_rank = []
    for r in range(dp_degree):
        dl = build_dataloader(
            mixture(),
            seq_len=SEQ,
            global_batch_size=8,
            local_batch_size=local_batch_size,
            dp_rank=r,
            dp_degree=dp_degree,
            seed=7,
            start_sample=start_sample,
            num_workers=num_workers,
        )
        per_rank.append([x[:, 0].tolist() for x, _ in itertools.islice(dl, n_steps * accum)])
    return [
        sum((per_rank[r][s * accum + m] for r in range(dp_degree) for m in range(accum)), []) for s in range(n_steps)
    ]


def test_the_mixture_is_layout_independent_and_resumes_exactly():
    ref = step_windows(1, 8, n_steps=6)
    assert step_windows(2, 2, n_steps=6, num_workers=2) == ref and step_windows(4, 1, n_steps=6) == ref
    assert step_windows(2, 4, n_steps=3, start_sample=24) == ref[3:]
    with pytest.raises(ValueError, match="seq_len 4, the loader was asked for 8"):
        build_dataloader(mixture(), seq_len=8, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1, seed=7)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, text in (("web.txt", "web page text. " * 400), ("code", None), ("books.txt", "a book. " * 900)):
        if text is None:
            (root / name).mkdir()
            (root / name / "a.txt").write_text("def f(x): return x\n" * 300)
        else:
            (root / name).write_text(text)
    return root


def test_build_corpus_checks_then_opens_every_source(files):
    tok = build_tokenizer("test")
    paths = [str(files / "web.txt"), str(files / "code"), str(files / "books.txt")]
    c = build_corpus(paths, tok, seq_len=16, weights=[2, 1, 1], val_fraction=0.1)
    assert [s.name for s in c.sources] == ["web", "code", "books"] and c.is_mixture
    assert [n for n, _ in c.validation] == ["web", "code", "books"]  # each source's held-out tail
    n = 10_000
    seen = c.seen(n)
    assert sum(tokens for tokens, _ in seen.values()) == n * 16
    assert abs(seen["web"][0] / (n * 16) - 0.5) < 1e-3
    assert c.epochs(n) == [k // s.n_windows for k, s in zip(c.samples_before(n), c.sources)] and max(c.epochs(n)) > 1
    # one validation stream, or one per source (a list as long as data.path)
    one = build_corpus(paths, tok, seq_len=16, weights=[2, 1, 1], validation_path=str(files / "books.txt"))
    assert [n for n, _ in one.validation] == ["validation"] and len(one.sources[2].train) == len(
        c.sources[2].train
    ) + len(c.sources[2].val)
    per = build_corpus(paths, tok, seq_len=16, weights=[2, 1, 1], validation_path=paths[::-1])
    assert [n for n, _ in per.validation] == ["web", "code", "books"]
    # no weights: the entries are one stream, end to end (as a folder is)
    single = build_corpus(paths, tok, seq_len=16, val_fraction=0.1)
    assert (
        not single.is_mixture
        and len(single.sources) == 1
        and single.seen(5) == {"corpus": (80, 5 / single.sources[0].n_windows)}
    )
    assert [source_name(p) for p in ("data/c4/*.json.gz", "fineweb.parquet", "/x/web/", "pile.jsonl.zst")] == [
        "c4",
        "fineweb",
        "web",
        "pile",
    ]


def test_bad_mixtures_are_one_line(files):
    tok = build_tokenizer("test")
    paths = [str(files / "web.txt"), str(files / "code")]
    with pytest.raises(ValueError) as e:
        build_corpus(
            paths + [str(files / "missing")], tok, seq_len=16, weights=[1, 0, float("nan")], validation_path="nope"
        )
    msg = str(e.value)
    assert msg.startswith("data.path: 3 bad inputs: ") and "\n" not in msg
    assert "data.weights has 3 weight(s) for 3" not in msg  # the count matches; the values do not
    for part in (
        "data.weights must be positive numbers, got 0, nan",
        "missing does not exist",
        "validation.path: data path nope does not exist",
    ):
        assert part in msg, msg
    with pytest.raises(
        ValueError, match="data.weights has 3 weight.s. for 2 data.path entries; give one weight per entry"
    ):
        build_corpus(paths, tok, seq_len=16, weights=[1, 1, 1])
    with pytest.raises(ValueError, match="needs two or more data.path entries"):
        build_corpus(paths[:1], tok, seq_len=16, weights=[1])
    with pytest.raises(ValueError, match=r"data.path '.*code' holds .* training tokens, fewer than one window"):
        build_corpus(paths, tok, seq_len=4000, weights=[1, 1])
