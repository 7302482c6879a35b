import json
import pickle

import numpy as np
import pytest
import torch

from titanlike.data import (
    PackedWindows,
    build_tokenizer,
    load_token_stream,
    open_token_file,
    sidecar_path,
    split_stream,
    write_token_file,
)
from titanlike.data.datasets import iter_token_chunks

DOCS = ["First document.\nWith two lines.", "Second: <|end_of_text|> is plain text here.", "Third, ünïcödé 🙂"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("test")


def expected(tok, docs):
    return [t for d in docs if d for t in tok.encode(d, eos=True)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_plain_text_file(tmp_path, tok):
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    s = load_token_stream(str(tmp_path / "a.txt"), tok)
    assert s.dtype == np.uint16
    assert s.tolist() == expected(tok, DOCS[:1])
    assert s[-1] == tok.eos_id


def test_folder_is_read_in_sorted_order_and_ignores_other_files(tmp_path, tok):
    (tmp_path / "b.txt").write_text(DOCS[1], encoding="utf-8")
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")  # an empty document contributes nothing
    write_jsonl(tmp_path / "c.jsonl", [{"text": DOCS[2]}])
    (tmp_path / "notes.md").write_text("not data", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("not read: folders are not recursed", encoding="utf-8")
    assert load_token_stream(tmp_path, tok).tolist() == expected(tok, DOCS)


def test_utf8_bom_is_dropped(tmp_path, tok):
    (tmp_path / "bom.txt").write_bytes("\ufeff".encode() + DOCS[0].encode())
    assert load_token_stream(tmp_path / "bom.txt", tok).tolist() == expected(tok, DOCS[:1])


def test_jsonl_with_custom_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": DOCS[0], "id": 1}, {"body": ""}, {"body": DOCS[1]}])
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n   \n" + json.dumps({"body": DOCS[2]}) + "\n")  # blank lines are skipped
    assert load_token_stream(str(path), tok, text_field="body").tolist() == expected(tok, DOCS)


def test_list_of_sources_keeps_order(tmp_path, tok):
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"text": DOCS[1]}, {"text": DOCS[2]}])
    s = load_token_stream([tmp_path / "b.jsonl", str(tmp_path / "a.txt")], tok)
    assert s.tolist() == expected(tok, [DOCS[1], DOCS[2], DOCS[0]])


def test_dtype_follows_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world", encoding="utf-8")
    assert load_token_stream(tmp_path / "a.txt", build_tokenizer("gpt2")).dtype == np.uint16
    cl = build_tokenizer("cl100k")
    s = load_token_stream(tmp_path / "a.txt", cl)
    assert s.dtype == np.uint32 and s.tolist() == [9906, 1917, cl.eos_id]


def test_large_batches_are_split_consistently(tmp_path, tok, monkeypatch):
    import titanlike.data.datasets as ds

    write_jsonl(tmp_path / "many.jsonl", [{"text": f"document number {i}"} for i in range(50)])
    whole = load_token_stream(tmp_path / "many.jsonl", tok)
    monkeypatch.setattr(ds, "_BATCH_CHARS", 40)  # force many tokenizer batches
    assert len(list(iter_token_chunks(tmp_path / "many.jsonl", tok))) > 10
    assert np.array_equal(load_token_stream(tmp_path / "many.jsonl", tok), whole)


def test_bin_round_trip_is_memory_mapped(tmp_path, tok):
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"text": DOCS[1]}])
    text_stream = load_token_stream([tmp_path / "a.txt", tmp_path / "b.jsonl"], tok)
    n = write_token_file(iter_token_chunks([tmp_path / "a.txt", tmp_path / "b.jsonl"], tok), tmp_path / "x.bin", tok)
    assert n == len(text_stream)
    meta = json.loads(sidecar_path(tmp_path / "x.bin").read_text())
    assert meta | {"n_tokens": n} == {
        "format": "titanlike-tokens",
        "version": 2,
        "dtype": "uint16",
        "n_tokens": n,
        "tokenizer": "test",
        "vocab_size": 2008,
        "eos_id": 2000,
        "min_id": int(text_stream.min()),  # version 2: the id range, checked against the vocabulary when indexed
        "max_id": 2000,
    }
    assert (tmp_path / "x.bin").stat().st_size == 2 * n
    loaded = load_token_stream(tmp_path / "x.bin", tok)
    assert isinstance(loaded, np.memmap) and not loaded.flags.writeable
    assert np.array_equal(loaded, text_stream)
    # .bin and text sources mix, in order.
    (tmp_path / "c.txt").write_text(DOCS[2], encoding="utf-8")
    mixed = load_token_stream([tmp_path / "c.txt", tmp_path / "x.bin"], tok)
    assert mixed.tolist() == expected(tok, [DOCS[2], DOCS[0], DOCS[1]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl", "c.txt", "x.bin", "x.bin.json"]


def test_bin_uint32(tmp_path):
    cl = build_tokenizer("cl100k")
    (tmp_path / "a.txt").write_text("Hello world", encoding="utf-8")
    write_token_file(iter_token_chunks(tmp_path / "a.txt", cl), tmp_path / "x.bin", cl)
    loaded = open_token_file(tmp_path / "x.bin", cl)
    assert loaded.dtype == np.uint32 and loaded.tolist() == [9906, 1917, 100257]


def _bin(tmp_path, tok):
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    write_token_file(iter_token_chunks(tmp_path / "a.txt", tok), tmp_path / "x.bin", tok)
    return tmp_path / "x.bin"


def test_bin_errors(tmp_path, tok):
    path = _bin(tmp_path, tok)
    with pytest.raises(ValueError, match=r"tokenized with 'test' .* this run uses 'gpt2'.*--tokenizer gpt2"):
        load_token_stream(path, build_tokenizer("gpt2"))
    with open(path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="truncated or overwritten"):
        load_token_stream(path, tok)
    sidecar_path(path).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_token_stream(path, tok)
    sidecar_path(path).unlink()
    with pytest.raises(ValueError, match=r"has no sidecar .*x\.bin\.json; re-run scripts/preprocess_data.py"):
        load_token_stream(path, tok)


def test_write_token_file_errors_leave_nothing_behind(tmp_path, tok):
    with pytest.raises(ValueError, match="must end in .bin"):
        write_token_file([np.array([1], np.uint16)], tmp_path / "x.dat", tok)
    with pytest.raises(ValueError, match="hold no text"):
        write_token_file([], tmp_path / "x.bin", tok)

    def failing():
        yield np.array([1, 2, 3], np.uint16)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        write_token_file(failing(), tmp_path / "y.bin", tok)
    assert list(tmp_path.iterdir()) == []


def test_source_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="does not exist"):
        load_token_stream(tmp_path / "missing.txt", tok)
    with pytest.raises(ValueError, match="holds no .txt or .jsonl files"):
        load_token_stream(tmp_path, tok)
    with pytest.raises(ValueError, match="no data path given"):
        load_token_stream([], tok)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 \(bad byte at offset 3\); convert it"):
        load_token_stream(tmp_path / "latin1.txt", tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        load_token_stream(tmp_path / "empty.txt", tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not a JSON object"):
        load_token_stream(bad, tok)
    bad.write_text('{"text": "ok"}\n["a list"]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no 'text' field; set text_field"):
        load_token_stream(bad, tok)
    bad.write_text('{"content": "ok"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no 'text' field"):
        load_token_stream(bad, tok)
    bad.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'text' is a int, not a string"):
        load_token_stream(bad, tok)


def test_split_stream():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_stream(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert np.array_equal(np.concatenate([train, val]), tokens) and val[0] == 900
    assert np.shares_memory(train, tokens)  # views, not copies
    train, val = split_stream(tokens, 0.0)
    assert len(train) == 1000 and len(val) == 0
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
            split_stream(tokens, bad)


def test_packed_windows_shift_labels():
    tokens = np.arange(103, dtype=np.uint16)
    w = PackedWindows(tokens, seq_len=10, shuffle=False)
    assert len(w) == 10  # (103 - 1) // 10
    for i in range(len(w)):
        inputs, labels = w[i]
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.tolist() == list(range(10 * i, 10 * i + 10))
        assert labels.tolist() == list(range(10 * i + 1, 10 * i + 11))
    with pytest.raises(IndexError):
        w[10]
    inputs, labels = w.batch(range(3))
    assert inputs.shape == labels.shape == (3, 10)
    assert (inputs[:, 1:] == labels[:, :-1]).all()


def test_sample_order_is_a_pure_function_of_global_index_and_seed():
    tokens = np.arange(8 * 37 + 1, dtype=np.uint16)
    a = PackedWindows(tokens, seq_len=8, seed=3)
    n = len(a)
    order = a.window_indices(range(3 * n))
    for e in range(3):  # each epoch visits every window once, in its own order
        assert sorted(order[e * n : (e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(order[:n], order[n : 2 * n])
    assert not np.array_equal(order[:n], np.arange(n))
    # Asking in any order, one at a time, or from a fresh object gives the same answer.
    b = PackedWindows(tokens, seq_len=8, seed=3)
    assert [b.window_index(g) for g in reversed(range(3 * n))] == order[::-1].tolist()
    g = 2 * n + 5
    assert b.sample(g)[0].tolist() == a[int(order[g])][0].tolist()
    assert not np.array_equal(PackedWindows(tokens, seq_len=8, seed=4).window_indices(range(n)), order[:n])
    assert PackedWindows(tokens, seq_len=8, shuffle=False).window_indices(range(2 * n)).tolist() == list(range(n)) * 2


def test_packed_windows_pickle_memmap_by_reference(tmp_path, tok):
    path = tmp_path / "big.bin"
    write_token_file([np.arange(20_000, dtype=np.uint16) % 2008], path, tok)
    train, val = split_stream(open_token_file(path, tok), 0.3)
    for part in (train, val):
        w = PackedWindows(part, seq_len=16, seed=1)
        blob = pickle.dumps(w)
        assert len(blob) < 1000  # (file, offset, length), not 10k+ tokens
        w2 = pickle.loads(blob)
        assert isinstance(w2.tokens, np.memmap) and np.array_equal(w2.tokens, part)
        assert np.array_equal(w2.window_indices(range(20)), w.window_indices(range(20)))
    in_memory = PackedWindows(np.arange(500, dtype=np.uint16), seq_len=4)
    assert np.array_equal(pickle.loads(pickle.dumps(in_memory)).tokens, np.arange(500))


def test_packed_windows_errors():
    with pytest.raises(ValueError, match=r"5 tokens cannot fill one window of seq_len \+ 1 = 9 tokens"):
        PackedWindows(np.arange(5), seq_len=8)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        PackedWindows(np.arange(5), seq_len=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        PackedWindows(np.arange(50), seq_len=4, seed=-1)
    with pytest.raises(ValueError, match="flat 1-D"):
        PackedWindows(np.zeros((4, 4)), seq_len=2)
    with pytest.raises(IndexError):
        PackedWindows(np.arange(50), seq_len=4).window_index(-1)
