"""issue 26's done-when: ``python train.py --model.name hf --model.hf_config <folder>`` trains a transformers model
(Phi-3 here: fused q|k|v with grouped kv heads, fused gate|up, the attention slicing with the config's head counts),
and ``torchrun`` tp2 + SP and pp2 runs of it in float64 equal that single process (<= 1e-10, 3 steps: loss and
gradient norm); the tp2 + SP run's DCP checkpoint of step 2 resumes in one process to the same step-3 loss
(resharding). The jobs run in tests/parallel/hf_trainer_worker.py (the trainer on forked ranks, exactly as under
torchrun); the per-gradient and per-weight equality of the same models is the gate's (gate.py, pipeline_gate.py)."""

from __future__ import annotations

import json
from pathlib import Path

from data_files import documents
from dist_utils import run_script
from hf_models import hf_folder

WORKER = Path(__file__).with_name("hf_trainer_worker.py")
TOL = 1e-10


def _rows(dump: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def test_hf_model_trains_alike_under_tp2_sp_and_pp2(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(documents(60, seed=3)))
    folder = hf_folder("hf_phi3", vocab_size=2048)  # the test tokenizer's 2k ids
    proc = run_script(WORKER, str(tmp_path), folder, "--data.path", str(corpus), timeout=900)
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*/rank*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    single = _rows(tmp_path / "single")
    assert sorted(single) == [1, 2, 3]
    for name in ("tp2_sp", "pp2"):
        other = _rows(tmp_path / name)
        assert sorted(other) == [1, 2, 3], name
        diffs = {k: max(abs(single[s][k] - other[s][k]) for s in single) for k in ("loss", "grad_norm")}
        print(f"{name} vs one process, max over 3 steps:", diffs)
        assert all(d <= TOL for d in diffs.values()), (name, diffs)
    assert single[3]["loss"] < single[1]["loss"] + 1.0  # it trained (finite, sane losses)
    # the tp2 + SP checkpoint of step 2, resumed in one process (DCP resharding): step 3 as the single process's
    resharded = _rows(tmp_path / "resharded")
    assert sorted(resharded) == [3], resharded
    assert abs(resharded[3]["loss"] - single[3]["loss"]) <= TOL, (resharded[3]["loss"], single[3]["loss"])
    log0 = (tmp_path / "tp2_sp" / "rank0.log").read_text()
    assert "model hf" in log0
