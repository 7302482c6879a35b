"""The formats corpora ship in, written by the real libraries (gzip, zstandard, pyarrow): read as a stream of
documents that tokenizes exactly like the same documents as plain JSON lines; globs and folders of mixed formats;
and every bad file — a corrupt / truncated / fake gzip, a truncated / corrupt zstandard file, a parquet file without
the column, with a non-string column or nulls, a file that is not parquet, a .bin holding ids outside the
vocabulary — named in one line, all in one run, exit code 2, before anything starts."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from data_files import documents, write_jsonl, write_jsonl_gz, write_jsonl_zst, write_parquet

from titanlike.data import build_tokenizer, check_sources, load_token_stream, open_tokens, sidecar_path
from titanlike.data.formats import iter_documents
from titanlike.data.shards import TokenWriter
from titanlike.training.trainer import main

DOCS = documents(120, seed=3)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("test")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {
        "jsonl": write_jsonl(root / "a.jsonl", DOCS),
        "jsonl.gz": write_jsonl_gz(root / "c4.json.gz", DOCS),
        "jsonl.zst": write_jsonl_zst(root / "pile.jsonl.zst", DOCS, frames=3),
        "parquet": write_parquet(root / "fineweb.parquet", DOCS, row_group_size=32),
    }


def test_every_format_yields_the_same_documents_and_tokens(good, tok):
    reference = load_token_stream(good["jsonl"], tok)
    for kind, path in good.items():
        assert list(iter_documents(path)) == DOCS, kind
        assert np.array_equal(load_token_stream(path, tok), reference), kind
        assert np.array_equal(open_tokens(path, tok).read(), reference), kind
    assert check_sources(list(good.values()), tok) == []


def test_globs_folders_and_the_text_field(tmp_path, good, tok):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_parquet(folder / "b.parquet", DOCS[:10], field="content")
    write_jsonl_gz(folder / "a.json.gz", DOCS[10:20], field="content")
    (folder / "notes.md").write_text("not data")
    (folder / "c.json").write_text("{}")  # a plain .json (a sidecar, a config) is not a data file
    expected = [d for d in DOCS[10:20] + DOCS[:10]]
    both = load_token_stream(folder, tok, text_field="content")
    assert np.array_equal(both, np.concatenate([load_token_stream(write_jsonl(tmp_path / "e.jsonl", expected), tok)]))
    glob = str(good["jsonl"].parent / "*.json*")  # c4.json.gz, pile.jsonl.zst, a.jsonl, sorted by name
    assert len(load_token_stream(glob, tok)) == 3 * len(load_token_stream(good["jsonl"], tok))
    assert check_sources([str(tmp_path / "nothing" / "*.parquet")], tok) == [
        f"data path glob {tmp_path / 'nothing' / '*.parquet'} matches no data file (a .txt, .jsonl, .jsonl.gz / "
        ".json.gz, .jsonl.zst / .json.zst, .parquet or .bin file)"
    ]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, good, tok):
    """Every kind of bad file of the new formats, as users produce them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("bad")
    gz = good["jsonl.gz"].read_bytes()
    (root / "truncated.json.gz").write_bytes(gz[: len(gz) // 2])
    corrupt = bytearray(gz)
    corrupt[len(corrupt) // 2] ^= 0xFF
    (root / "corrupt.json.gz").write_bytes(bytes(corrupt))
    (root / "fake.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
    zst = good["jsonl.zst"].read_bytes()
    (root / "truncated.jsonl.zst").write_bytes(zst[: len(zst) - 100])
    flipped = bytearray(zst)
    flipped[len(flipped) // 3] ^= 0xFF
    (root / "corrupt.jsonl.zst").write_bytes(bytes(flipped))
    (root / "badline.json.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"body": "elsewhere"}\n'))
    write_parquet(root / "nocolumn.parquet", DOCS[:5], field="content")
    pq.write_table(pa.table({"text": [1, 2, 3]}), str(root / "ints.parquet"))
    pq.write_table(pa.table({"text": ["a doc", None, "another", None]}), str(root / "nulls.parquet"))
    (root / "notparquet.parquet").write_bytes(b"PAR1 this is not a parquet file")
    # a .bin whose sidecar names the right tokenizer but that holds ids outside its vocabulary
    with TokenWriter(root / "lies.bin", tok) as w:
        w.write(np.arange(1000, dtype=np.uint16))
        w.commit()
    raw = np.fromfile(root / "lies.bin", dtype=np.uint16)
    raw[::10] = 60000
    raw.tofile(root / "lies.bin")
    meta = json.loads(sidecar_path(root / "lies.bin").read_text())
    # ... and one whose sidecar admits it (a hand-made sidecar that is consistent with the file)
    raw.tofile(root / "outside.bin")
    sidecar_path(root / "outside.bin").write_text(json.dumps(meta | {"max_id": 60000}))
    return root


EXPECTED = {
    "truncated.json.gz": "is truncated: the gzip stream ends before its end marker",
    "corrupt.json.gz": ("is a corrupt gzip file", "is not a valid gzip file (CRC check failed"),
    "fake.jsonl.gz": "is not a valid gzip file (Not a gzipped file",
    "truncated.jsonl.zst": "is truncated: its last zstandard frame ends before its end marker",
    "corrupt.jsonl.zst": "is not a valid zstandard file",
    "badline.json.gz": ": 1 bad line(s), the first: line 2 has no 'text' field (keys: body)",
    "nocolumn.parquet": "has no column 'text' (columns: id, content); set data.text_field",
    "ints.parquet": ": column 'text' holds int64, not strings",
    "nulls.parquet": ": 2 row(s) with a null 'text', the first row 1",
    "notparquet.parquet": "is not a readable parquet file",
    "lies.bin": "holds ids 1..60000 in a sample but its sidecar says 0..999",
    "outside.bin": "holds token id 60000 but the vocabulary of 'test' has 2008 ids",
}


def test_every_bad_file_in_one_line_before_anything_starts(bad, tmp_path, capsys):
    argv = [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "1",
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--data.path",
        str(bad),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: data.path: {len(EXPECTED)} bad inputs: ") and "\n" not in err, err
    for name, whys in EXPECTED.items():
        whys = (whys,) if isinstance(whys, str) else whys  # a flipped byte: a bad deflate block or a bad CRC
        assert any(f"{bad / name}{'' if w.startswith(':') else ' '}{w}" in err for w in whys), (name, err)
    assert not (tmp_path / "run").exists()


def test_a_shard_changed_after_indexing_is_named_not_fed_to_the_embedding(tmp_path, tok):
    path = tmp_path / "x.bin"
    with TokenWriter(path, tok) as w:
        w.write(np.arange(5000, dtype=np.uint16) % 2000)
        w.commit()
    tokens = open_tokens(path, tok)
    raw = np.fromfile(path, dtype=np.uint16)
    raw[2500] = 65000  # between the sampled blocks; written after the index was built
    raw.tofile(path)
    assert np.array_equal(tokens.read(0, 100), np.arange(100))
    with pytest.raises(ValueError, match=r"x.bin holds token id 65000 at token 2500, outside the vocabulary"):
        tokens.gather(np.array([0, 2490]), 17)
