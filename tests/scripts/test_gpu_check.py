"""scripts/gpu_check.sh end to end in its CPU dry mode (tiny model, float8 through torchao's emulation, the debug
config for train.py), so the prepared GPU check cannot rot; timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _memory_modes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_modes", REPO / "scripts" / "memory_modes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_writes_every_row(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--wheels", "none", "--out", str(tmp_path), "--budget", "3000"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_codes"] == {
        k: "0"
        for k in (
            "bf16_b4",
            "bf16_b8",
            "float8_tw_b4",
            "float8_rw_b4",
            "fsdp_on_b4",
            "train_1b",
            "bf16_b8_ac_op",
            "moe_bench",
            "muon_step",
            "mask_bench",
            "train_gpt_oss",
            "deepseek_v3",
            "linear_bench",
            "memory_modes",
            "act_offload",
            "cp_methods",
            "host_reads",
            "pp_uneven",
        )
    }, proc.stdout
    rows = {r["row"]: r for r in summary["rows"]}
    assert set(rows) == {"bf16_b4", "bf16_b8", "float8_tw_b4", "float8_rw_b4", "fsdp_on_b4", "bf16_b8_ac_op"}
    assert rows["float8_tw_b4"]["float8"] == "tensorwise" and rows["float8_rw_b4"]["float8"] == "rowwise"
    assert rows["fsdp_on_b4"]["fsdp"] == "on" and rows["bf16_b4"]["fsdp"] == "auto"
    assert rows["bf16_b8_ac_op"]["ac"] == "op"
    for r in rows.values():  # every titanlike row has a plain row of its batch size to be compared with
        assert r["tokens_per_s"] > 0 and r["ratio_to_plain"] > 0 and r["loss"] > 0, r
    assert [r["step"] for r in summary["train_1b"]] == [1, 2, 3]
    assert summary["env"]["torchao"] == "0.18.0"
    assert set(summary["moe"]["rows"]) == {"grouped", "loop"} and summary["moe"]["ratio_grouped_over_loop"] > 0
    # the Muon row: 2 gloo ranks in the dry mode, every matrix orthogonalized once (7 of 14 each), naive: all on each
    muon = summary["muon_step"]["rows"]
    assert set(muon) == {"adamw", "muon", "naive_muon"} and all(r["seconds"] > 0 for r in muon.values())
    assert [c["matrices"] for c in muon["muon"]["ranks"]] == [7, 7]
    assert [c["matrices"] for c in muon["naive_muon"]["ranks"]] == [14, 14]
    ds = {r["name"]: r for r in summary["deepseek_v3"]["rows"]}  # MLA + DeepSeek MoE + MTP, titanlike vs plain
    assert set(ds) == {"titanlike", "plain"} and all(r["tokens_per_s"] > 0 for r in ds.values())
    mask = summary["mask"]  # block_causal vs causal on one batch, and the shipped corpus's skipped share
    assert mask["backend"] == "sdpa" and mask["ratio_block_causal_over_causal"] > 0
    assert 0 < mask["batch_pair_fraction"] < 1 and 0 < mask["corpus"]["flops_skipped"] < 0.01
    assert 0 < mask["window_pair_fraction"] < 1 and mask["ratio_window_sinks_over_causal"] > 0
    assert [r["step"] for r in summary["train_gpt_oss"]] == [1, 2]  # gpt-oss: window, sinks, block_causal
    linear = summary["linear"]  # Gated DeltaNet: chunked vs recurrent (no flash-linear-attention on CPU), the scan
    assert set(linear["forms"]["rows"]) == {"chunked", "recurrent"} and linear["scan"]["sent_bytes"] > 0
    memory_modes = _memory_modes()
    modes = summary["memory_modes"]  # every memory mode on 2 ranks, the activation modes in one process
    assert {r["mode"] for r in modes["modes"]["rows"]} == set(memory_modes.MODES)
    assert {r["mode"] for r in modes["one_device"]["rows"]} == set(memory_modes.ONE)
    assert all(r["Total"] > 0 for m in modes.values() for r in m["rows"])
    # the trainer's reads per step (7 steps logging at 1 and 7): nothing between the log steps
    reads = summary["host_reads"]
    assert [r["step"] for r in reads] == list(range(1, 8)) and reads[0]["reads"] > 0 and reads[-1]["reads"] > 0
    assert all(r["reads"] == 0 for r in reads[1:-1]), reads
    assert "pipeline split: blocks per stage 8 8 8 8 8 7 7 7" in (tmp_path / "pp_uneven.log").read_text()


def test_gpu_check_bad_argument_is_one_line(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "tpu", "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "gpu_check.sh: --device must be cuda or cpu, got 'tpu'"
    assert not (tmp_path / "o").exists()
