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
