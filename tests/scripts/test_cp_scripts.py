"""The context-parallel numbers scripts run: activation memory per rank (real gloo ranks) and the planner's price."""

from __future__ import annotations

import cp_memory
import cp_price


def test_cp_memory_shrinks_the_per_token_activations(capsys):
    assert cp_memory.main(["--flavor", "tiny", "--seq-len", "512", "--vocab", "256", "--cps", "1,2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [r[0] for r in rows] == ["1", "2"]
    outside_ratio, total_ratio = float(rows[1][2]), float(rows[1][6])
    assert 0.45 < outside_ratio < 0.6, rows  # everything outside attention is per token: about 1/cp
    assert total_ratio < 0.8, rows


def test_cp_price_prints_a_row_per_layout(capsys):
    assert cp_price.main(["--configs", "configs/llama3_8b.toml", "--seq-lens", "65536", "--cps", "1,4"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("llama3_8b")]
    # cp 4 at 64k tokens: dp_shard 64 / 4 = 16; one K (or V): 65536 x 8 kv heads x 128 x bf16 = 128 MiB
    assert rows[1][:6] == ["llama3_8b", "65,536", "4", "16", "128.00", "MiB"], rows
    assert rows[0][:6] == ["llama3_8b", "65,536", "1", "64", "0", "B"], rows
