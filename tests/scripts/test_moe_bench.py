"""scripts/moe_bench.py on CPU with a tiny layer, in-process: both rows print with positive numbers, the ratio
line, the JSON, the two paths computing the same output (timings not asserted); bad arguments are one line, exit
code 2."""

from __future__ import annotations

import json

import moe_bench
import pytest
import torch


def test_moe_bench_prints_both_rows_and_the_ratio(tmp_path, capsys):
    out = tmp_path / "moe.json"
    small = ["--tokens", "64", "--dim", "16", "--hidden", "32", "--experts", "4", "--top-k", "2"]
    threads = torch.get_num_threads()
    try:
        moe_bench.main([*small, "--steps", "2", "--warmup", "1", "--device", "cpu", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    for name in ("grouped", "loop"):
        row = next(line for line in lines if line.startswith(name))
        assert float(row.split()[1].replace(",", "")) > 0, row
    assert any(line.startswith("ratio grouped/loop:") for line in lines)
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"grouped", "loop"} and result["ratio_grouped_over_loop"] > 0
    assert result["max_output_diff"] < 1e-5  # the same layer, the same routing
    assert result["routed_rows"] == 128 and result["padded_rows"] >= 128
    assert result["args"]["dtype"] == "float32"


def test_moe_bench_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        moe_bench.parse(["--dim", "6", "--top-k", "9", "--experts", "4", "--device", "cpu"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--dim 6 is not a multiple of 4 (float32)" in last and "--top-k 9 exceeds --experts 4" in last, last


def test_moe_bench_float8_row_is_refused_in_one_line_without_a_hopper_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        moe_bench.parse(["--float8", "--device", "cpu"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("--float8: torchao's float8 grouped GEMM has no emulation (on cpu)"), last
