import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titanlike.data import build_tokenizer, load_token_stream, open_token_file

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "preprocess_data.py"


def load_script():
    spec = importlib.util.spec_from_file_location("preprocess_data_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "b.txt").write_text("The second book.\n", encoding="utf-8")
    (folder / "a.txt").write_text("The first book, ünïcödé.\n", encoding="utf-8")
    jsonl = tmp_path / "web.jsonl"
    jsonl.write_text("".join(json.dumps({"content": f"page {i}"}) + "\n" for i in range(3)), encoding="utf-8")
    return folder, jsonl


def test_cli_round_trip(tmp_path):
    folder, jsonl = make_inputs(tmp_path)
    out = tmp_path / "out" / "corpus.bin"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tokenizer",
            "gpt2",
            "--input",
            str(folder),
            str(jsonl),
            "--output",
            str(out),
            "--text-field",
            "content",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tok = build_tokenizer("gpt2")
    expected = load_token_stream([folder, jsonl], tok, text_field="content")
    assert f"wrote {len(expected):,} tokens (gpt2, vocab 50257) to {out}" in proc.stdout
    assert np.array_equal(open_token_file(out, tok), expected)
    assert tok.decode(expected).split("<|endoftext|>")[:-1] == [
        "The first book, ünïcödé.\n",
        "The second book.\n",
        "page 0",
        "page 1",
        "page 2",
    ]
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus.bin", "corpus.bin.json"]  # no temp files left


def test_overwrite_and_bad_input(tmp_path, capsys):
    script = load_script()
    folder, _ = make_inputs(tmp_path)
    out = tmp_path / "x.bin"
    assert script.main(["--tokenizer", "test", "--input", str(folder), "--output", str(out)]) == 0
    before = out.read_bytes(), (tmp_path / "x.bin.json").read_text()
    capsys.readouterr()
    # A failed run (bad UTF-8 in the second file) leaves the previous output intact and no temp files.
    (folder / "c.txt").write_bytes(b"caf\xe9")
    assert script.main(["--tokenizer", "test", "--input", str(folder), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "c.txt is not UTF-8" in err
    assert (out.read_bytes(), (tmp_path / "x.bin.json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books", "web.jsonl", "x.bin", "x.bin.json"]
    assert script.main(["--tokenizer", "gpt5", "--input", str(folder), "--output", str(out)]) == 2
    assert "neither a known name (gpt2, cl100k, test)" in capsys.readouterr().err
    # Rewriting with another tokenizer replaces both files consistently.
    (folder / "c.txt").unlink()
    assert script.main(["--tokenizer", "cl100k", "--input", str(folder), "--output", str(out)]) == 0
    assert open_token_file(out, build_tokenizer("cl100k")).dtype == np.uint32


def test_cli_requires_arguments(tmp_path):
    with pytest.raises(SystemExit):
        load_script().main(["--tokenizer", "gpt2"])


# ---------------------------------------------------------------------------------------------
# At scale: every format, sharded, on several workers, atomic per shard, resumable

SHARD = 3000  # tokens per shard: several shards per input


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from data_files import documents, write_jsonl_gz, write_jsonl_zst, write_parquet

    root = tmp_path_factory.mktemp("inputs")
    docs = documents(200, seed=11)
    write_jsonl_gz(root / "a.json.gz", docs[:50])
    write_jsonl_zst(root / "b.jsonl.zst", docs[50:100], frames=3)
    write_parquet(root / "c.parquet", docs[100:], row_group_size=20)
    (root / "d.txt").write_text("A plain text document.\n" * 30)
    return root


def _shards(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.bin*"))}


def test_sharded_output_on_workers_equals_one_stream_and_resumes(inputs, tmp_path, capsys):
    from titanlike.data import open_tokens
    from titanlike.data.preprocess import STATE

    script, out = load_script(), tmp_path / "out"
    argv = ["--tokenizer", "gpt2", "--input", str(inputs), "--output", str(out), "--shard-tokens", str(SHARD)]
    assert script.main([*argv, "--workers", "2"]) == 0
    stdout, stderr = capsys.readouterr()
    tok = build_tokenizer("gpt2")
    expected = load_token_stream(inputs, tok)
    shards = sorted(out.glob("shard-*.bin"))
    assert f"wrote {len(expected):,} tokens in {len(shards)} shard(s) (gpt2, vocab 50257) to {out}" in stdout
    # the progress line: documents, tokens, tokens/s (stderr is not a terminal here: the final line)
    assert "preprocess: 4/4 units  201 documents  " in stderr and f"{len(expected):,} tokens" in stderr
    assert "tokens/s" in stderr
    # bounded shards (a unit's last one is shorter), read in name order they are exactly the one stream
    sizes = [json.loads(p.with_name(p.name + ".json").read_text())["n_tokens"] for p in shards]
    assert max(sizes) == SHARD and len(shards) > 4
    assert np.array_equal(open_tokens(out, tok).read(), expected)
    assert not [p for p in out.iterdir() if p.name.startswith(".shard")]  # no temporary file left
    first = _shards(out)
    # Interrupted runs: a unit killed after its first shard (its marker, later shards gone, a temporary file left),
    # and one killed before the marker of its last shard was written.
    parts = sorted(out.glob("shard-00002-*.bin"))
    assert len(parts) >= 3
    doc, offset = json.loads(parts[0].with_name(parts[0].name + ".json").read_text())["source"]["end"]
    assert offset > 0  # the first shard ends inside a document: the resume continues inside it
    for p in parts[1:]:
        p.unlink()
        p.with_name(p.name + ".json").unlink()
    (out / STATE / "unit-00002.done").unlink()
    (out / STATE / "unit-00001.done").unlink()
    (out / ".shard-00002-00001.bin.x1y2").write_bytes(b"partial")
    assert script.main([*argv, "--workers", "1"]) == 0  # another worker count resumes the same units
    stdout = capsys.readouterr()[0]
    assert "3 of 4 units were done already" in stdout and f"wrote {sum(sizes[-len(parts) + 1 :]) if False else ''}"
    assert _shards(out) == first  # byte for byte, the sidecars included
    assert not [p for p in out.iterdir() if p.name.startswith(".shard")]
    # A finished folder reruns as a no-op; other settings are refused, naming them.
    assert script.main([*argv, "--workers", "2"]) == 0 and "4 of 4 units were done already" in capsys.readouterr()[0]
    assert script.main([*argv[:-1], "5000"]) == 2
    assert "holds the shards of another preprocessing (shard_tokens differ)" in capsys.readouterr()[1]
    assert _shards(out) == first


def test_a_bad_input_fails_its_unit_only_and_is_reported_with_the_others(inputs, tmp_path, capsys):
    import shutil

    script, root, out = load_script(), tmp_path / "in", tmp_path / "out"
    shutil.copytree(inputs, root)
    good = (root / "b.jsonl.zst").read_bytes()
    (root / "b.jsonl.zst").write_bytes(good[:-50])  # truncated
    (root / "e.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    argv = ["--tokenizer", "test", "--input", str(root), "--output", str(out), "--shard-tokens", str(SHARD)]
    assert script.main([*argv, "--workers", "2", "--no-progress"]) == 2
    err = capsys.readouterr()[1].strip()
    assert err.startswith("error: 2 bad inputs (the other units' shards are written") and "\n" not in err
    assert "b.jsonl.zst is truncated" in err and "e.jsonl:2: field 'text' is a int, not a string" in err
    assert sorted({p.name.split("-")[1] for p in out.glob("shard-*.bin")}) == ["00000", "00002", "00003"]
    # fixed, the rerun completes only the failed units; a unit's shards from before the failure are kept
    (root / "b.jsonl.zst").write_bytes(good)
    (root / "e.jsonl").write_text('{"text": "fine"}\n{"text": "three"}\n')
    assert script.main([*argv, "--no-progress"]) == 0
    tok = build_tokenizer("test")
    from titanlike.data import open_tokens

    assert np.array_equal(open_tokens(out, tok).read(), load_token_stream(root, tok))
    assert "3 of 5 units were done already" in capsys.readouterr()[0]
    assert (
        script.main(["--tokenizer", "test", "--input", str(root), "--output", str(out / "x.bin"), "--workers", "2"])
        == 2
    )
    assert "a single .bin is written by one process" in capsys.readouterr()[1]


def test_throughput_side_by_side_with_the_plain_batch_encoder_loop(inputs):
    """A smoke run of the measurement (the ratio itself is measured on a real corpus, docs/data.md)."""
    from titanlike.data.preprocess import benchmark

    r = benchmark([str(inputs)], "gpt2", workers=2, repeat=1)
    assert r["tokens"] == len(load_token_stream(inputs, build_tokenizer("gpt2")))
    assert r["ratio"] > 0 and r["cpu_ratio"] > 0 and len(r["ours"]) == len(r["plain_cpu"]) == 1
