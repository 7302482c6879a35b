"""scripts/ep_dispatch_bench.py with a tiny layer on one process (in-process; the 2-rank run is the documented
command): both dispatches print, compute the same output, and the padded one computes experts x tokens rows with a
larger peak (timings not asserted); bad arguments are one line, exit code 2."""

from __future__ import annotations

import json

import ep_dispatch_bench
import pytest
import torch


def test_ep_dispatch_bench_prints_both_dispatches(tmp_path, capsys):
    out = tmp_path / "ep.json"
    small = ["--ep", "1", "--tokens", "64", "--dim", "16", "--hidden", "32", "--experts", "4", "--top-k", "2"]
    threads = torch.get_num_threads()
    try:
        ep_dispatch_bench.main([*small, "--steps", "1", "--warmup", "0", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("padded / uneven: time") for line in lines)
    result = json.loads(out.read_text())
    assert result["max_output_diff"] < 1e-6
    assert result["uneven"]["expert_rows"] == 128 and result["padded"]["expert_rows"] == 4 * 64
    assert result["padded"]["peak_mib"] > result["uneven"]["peak_mib"] > 0
    assert result["padded"]["a2a_mib_sent"] == result["uneven"]["a2a_mib_sent"] == 0  # one process: no all-to-all


def test_ep_dispatch_bench_refuses_bad_arguments_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        ep_dispatch_bench.main(["--ep", "3", "--experts", "4"])
    assert exc.value.code == 2
    assert "--ep 3 does not divide --experts 4" in capsys.readouterr().err
