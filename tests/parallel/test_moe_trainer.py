"""issue 22's done-when: ``torchrun --nproc_per_node=2 train.py --model.name qwen3_moe --model.flavor debugmodel
--parallelism.expert_parallel_degree 2`` trains, and in float64 its losses, gradient norms, aux losses, expert loads
and expert biases equal ``python train.py`` of the same config (<= 1e-10, 4 steps, the bias update and the aux loss
on). The planted bugs of this wiring (the bias update from local loads, ...) run in the gate. The jobs run in
tests/parallel/moe_trainer_worker.py (the trainer on forked ranks, exactly as under torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from data_files import documents
from dist_utils import worker_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("moe_trainer_worker.py")
STEPS = 4
TOL = 1e-10


def _rows(dump: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def _biases(dump: Path, rank: int = 0) -> torch.Tensor:
    return torch.stack(torch.load(dump / f"biases_rank{rank}.pt"))  # (steps, layers, experts)


def test_qwen3_moe_ep2_trains_like_one_process(tmp_path):
    corpus = tmp_path / "corpus.txt"  # small: the shipped corpus takes seconds to tokenize, per job
    corpus.write_text("\n\n".join(documents(60, seed=3)))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "--data.path", str(corpus)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*/rank*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    single, ep2 = (_rows(tmp_path / n) for n in ("single", "ep2"))
    assert sorted(single) == sorted(ep2) == list(range(1, STEPS + 1))
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_load_max_over_mean")
    diffs = {k: max(abs(single[s][k] - ep2[s][k]) for s in single) for k in keys}
    print("ep2 vs one process, max over 4 steps:", diffs)
    for step in single:
        for k in keys:
            assert abs(single[step][k] - ep2[step][k]) <= TOL, (step, k, single[step][k], ep2[step][k])
    ref = _biases(tmp_path / "single")
    assert ref.shape == (STEPS, 2, 8) and ref.abs().max() > 0  # the update acted
    for rank in (0, 1):  # identical on both ranks, and equal to one process
        assert (_biases(tmp_path / "ep2", rank) - ref).abs().max() <= TOL
    log0 = (tmp_path / "ep2" / "rank0.log").read_text()
    assert "ep groups of 2" in log0 and "M active per token" in log0
    assert "aux " in log0 and "load max/mean" in log0
    # the layers x experts load picture of the last log step, one cell per (MoE layer, expert), in the dump folder
    for run in ("single", "ep2"):
        svg = ET.parse(tmp_path / run / "expert_load.svg").getroot()
        cells = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect")]
        assert len(cells) == 2 * 8, run
        assert f"at step {STEPS}" in "".join(t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text"))
    assert single[STEPS]["moe_dropped_tokens"] == 0
