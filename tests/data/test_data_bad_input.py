"""Data files as they come: the trainer checks every data file before any process group starts and reports every
bad one in one line (exit code 2), in one process and under torchrun; latin-1 on purpose; dump folder, steps 0,
another run's metrics.jsonl, validation skipped for lack of held-out data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titanlike.data import build_tokenizer, write_token_file
from titanlike.training.trainer import main

REPO = Path(__file__).resolve().parents[2]
LATIN1 = "caf\xe9 au lait, na\xefve r\xe9sum\xe9, \xe0 la carte. " * 40


def args(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "1",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "16",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "100",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Every kind of bad file, as users produce them."""
    root = tmp_path_factory.mktemp("data")
    folder = root / "corpus"
    folder.mkdir()
    (folder / "empty.txt").write_bytes(b"")
    (folder / "random.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    (folder / "latin1.txt").write_bytes(LATIN1.encode("latin-1"))
    (folder / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "the text is elsewhere"}\n')
    (folder / "malformed.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated\n')
    (folder / "good.txt").write_text("Some good text. " * 50)
    (root / "empty_folder").mkdir()
    test, gpt2 = build_tokenizer("test"), build_tokenizer("gpt2")
    write_token_file([np.arange(1000)], root / "truncated.bin", test)
    with open(root / "truncated.bin", "r+b") as f:
        f.truncate(700)
    write_token_file([np.arange(1000)], root / "gpt2.bin", gpt2)
    (root / "short.txt").write_text("too short")
    (root / "latin1.txt").write_bytes(LATIN1.encode("latin-1"))
    (root / "a_file").write_text("not a folder")
    return root


def fails(capsys, argv, *expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for e in expected:
        assert e in err, (e, err)
    return err


def test_every_bad_file_in_one_line(bad, tmp_path, capsys):
    folder = bad / "corpus"
    err = fails(
        capsys,
        args(tmp_path, "--data.path", str(folder)),
        "5 bad inputs",
        f"{folder / 'empty.txt'} is empty",
        f"{folder / 'random.txt'} ",
        "is not UTF-8",
        f"{folder / 'latin1.txt'} is not UTF-8 (byte 0xe9",
        "data.encoding = 'latin-1'",
        f"{folder / 'nofield.jsonl'}: 1 bad line(s), the first: line 2 has no 'text' field (keys: body)",
        f"{folder / 'malformed.jsonl'}: 1 bad line(s), the first: line 2 is not a JSON object",
    )
    assert "good.txt" not in err
    fails(
        capsys,
        args(tmp_path, "--data.path", str(bad / "empty_folder")),
        "holds no .txt or .jsonl files",
        "(it is empty)",
    )
    fails(capsys, args(tmp_path, "--data.path", str(bad / "truncated.bin")), "truncated or overwritten")
    fails(
        capsys,
        args(tmp_path, "--data.path", str(bad / "gpt2.bin")),
        "was tokenized with 'gpt2'",
        "this run uses 'test'",
    )
    fails(
        capsys,
        args(tmp_path, "--data.path", str(bad / "short.txt")),
        "fewer than one window of training.seq_len + 1 = 17",
    )
    fails(
        capsys,
        args(tmp_path, "--data.path", str(bad / "latin1.txt"), "--data.encoding", "latin-9x"),
        "data.encoding: 'latin-9x' is not a text encoding",
    )
    # Nothing was written for any of them.
    assert not any(tmp_path.iterdir())


def test_latin1_on_purpose_and_other_inputs(bad, tmp_path, capsys):
    for extra in (["--data.encoding", "latin-1"], ["--data.encoding_errors", "replace"]):
        dump = tmp_path / extra[1]
        assert main(args(dump, "--data.path", str(bad / "latin1.txt"), *extra)) == 0
        assert (dump / "metrics.jsonl").is_file()
    capsys.readouterr()
    fails(
        capsys,
        args(bad / "a_file", "--data.path", str(bad / "latin1.txt")),
        f"job.dump_folder: '{bad / 'a_file'}' is a file, not a folder",
    )
    fails(capsys, args(tmp_path, "--training.steps", "0"), "training.steps: 0 trains nothing")
    fails(capsys, args(tmp_path, "--data.encoding_errors", "lenient"), "data.encoding_errors")


def test_a_fresh_run_never_appends_to_another_runs_metrics_and_skipped_validation_says_so(bad, tmp_path, capsys):
    data = ["--data.path", str(bad / "latin1.txt"), "--data.encoding", "latin-1"]
    assert main(args(tmp_path, *data)) == 0
    first = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert (
        main(
            args(tmp_path, *data, "--training.seed", "3", "--validation.enable", "true", "--data.val_fraction", "0.01")
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"metrics: {tmp_path / 'metrics.jsonl'} holds another run's metrics; moved it to metrics.jsonl.1" in out
    assert (tmp_path / "metrics.jsonl.1").read_text() == first
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1]
    assert "validation: skipped, the held-out tail" in out and "raise data.val_fraction" in out


def test_bad_data_under_torchrun_is_one_line_from_one_rank(bad, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "0",
            "train.py",
            *args(tmp_path, "--data.path", str(bad / "corpus")),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "5 bad inputs" in ours[0], proc.stdout + proc.stderr
    # no traceback from titanlike: what follows is torchrun's own report of the child's exit code 2
    assert "titanlike/" not in proc.stderr and "exitcode  : 2" in proc.stderr, proc.stderr
    assert proc.returncode != 0 and not any(tmp_path.iterdir())
