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


def test_cp_memory_side_by_side_by_method(capsys):
    """Each cp method on real gloo ranks: the attention core holds less than the all-gather's whole-sequence K / V
    under the all-to-all and the ring, and every method sends bytes per layer."""
    argv = [
        "--flavor",
        "tiny",
        "--seq-len",
        "512",
        "--vocab",
        "256",
        "--cps",
        "1,2",
        "--methods",
        "allgather,alltoall,ring",
    ]
    assert cp_memory.main(argv) == 0
    rows = {
        (r[0], r[1]): r
        for r in (line.split() for line in capsys.readouterr().out.splitlines())
        if r[:1] in (["1"], ["2"])
    }
    assert set(rows) == {("1", "allgather"), ("2", "allgather"), ("2", "alltoall"), ("2", "ring")}
    core = {m: float(rows[("2", m)][5]) for m in ("allgather", "alltoall", "ring")}
    assert core["alltoall"] < core["allgather"] and core["ring"] < core["allgather"], rows
    assert all(float(rows[("2", m)][8]) > 0 for m in core), rows


def test_cp_price_side_by_side_by_method(capsys):
    argv = ["--configs", "configs/llama3_8b.toml", "--seq-lens", "131072", "--cps", "8"]
    assert cp_price.main([*argv, "--methods", "allgather,alltoall,ring", "--ac", "none"]) == 0
    rows = {r[3]: r for r in (line.split() for line in capsys.readouterr().out.splitlines()) if r[:1] == ["llama3_8b"]}
    # the K/V one layer holds per rank: the whole sequence's (2 GiB), 1/cp of it, 1/cp + the arriving pair
    assert rows["allgather"][5:7] == ["2.00", "GiB"] and rows["alltoall"][5:7] == ["256.00", "MiB"], rows
    assert rows["ring"][5:7] == ["320.00", "MiB"], rows
