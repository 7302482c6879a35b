"""scripts/linear_attention_bench.py on CPU with a tiny shape, in-process (the scan on 2 forked gloo ranks): both
forms print with positive numbers and agree, the cp bytes table shows the Gated DeltaNet bytes constant and the
attention bytes growing with seq_len, the bytes one rank sends equal the formula; bad arguments are one line, exit
code 2."""

from __future__ import annotations

import json

import linear_attention_bench
import pytest
import torch


def test_bench_prints_both_forms_the_cp_table_and_the_scan(tmp_path, capsys):
    out = tmp_path / "la.json"
    small = ["--seq", "48", "--heads", "2", "--dk", "8", "--dv", "8", "--chunk", "16", "--steps", "1", "--warmup", "0"]
    threads = torch.get_num_threads()
    try:
        linear_attention_bench.main(
            [*small, "--device", "cpu", "--seq-lens", "4096,65536", "--scan-reps", "2", "--json", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    for name in ("chunked", "recurrent"):
        row = next(line for line in lines if line.startswith(name))
        assert float(row.split()[1].replace(",", "")) > 0, row
    result = json.loads(out.read_text())
    assert result["forms"]["max_output_diff_vs_recurrent"]["chunked"] < 1e-5
    short, long = result["cp_bytes"]
    assert (
        short["deltanet_bytes"] == long["deltanet_bytes"] and long["attention_bytes"] == 16 * short["attention_bytes"]
    )
    assert result["scan"]["sent_bytes"] == result["scan"]["formula_bytes"] > 0
    assert any(line.startswith("scan over 2 gloo ranks") for line in lines)


def test_bench_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        linear_attention_bench.parse(["--seq", "0", "--cp", "1", "--device", "cpu"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seq 0 must be >= 1" in last and "--cp 1" in last, last
