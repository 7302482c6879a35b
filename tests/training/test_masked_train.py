"""Done-when of document masking: ``train.py --model.attn_mask_type block_causal`` (with positions reset per
document) trains, and ``torchrun`` cp 2 and pp 2 (ZBV) runs of it log the same losses, gradient norms and validation
losses as the one process, in float64 (<= 1e-10). The corpus is a .jsonl of short documents (the shipped one is 14
long books: a 64-token window almost never holds two documents), so most windows hold several. One launch
(tests/training/mask_train_worker.py) runs the three jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data_files import documents, write_jsonl
from dist_utils import worker_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("mask_train_worker.py")


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_block_causal_cp2_and_pp2_zbv_equal_one_process(tmp_path):
    docs = [d[: 40 + 37 * (i % 5)] for i, d in enumerate(documents(300, seed=2, max_paragraphs=1))]
    corpus = write_jsonl(tmp_path / "docs.jsonl", docs)
    argv = [
        *("--job.config_file", str(REPO / "configs/debug_model.toml")),
        *("--model.attn_mask_type", "block_causal", "--model.reset_position_ids", "true"),
        *("--data.path", str(corpus), "--training.dtype", "float64", "--training.steps", "3"),
        *("--training.seq_len", "64", "--training.local_batch_size", "4", "--model.max_seq_len", "64"),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"),
        *("--validation.freq", "3", "--validation.steps", "1", "--lr_scheduler.warmup_steps", "1"),
    ]
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "--", *argv],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=480,
    )
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("*/rank*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + logs
    assert "attention: block_causal mask" in proc.stdout and "positions restart per document" in proc.stdout
    single = _rows(tmp_path / "single")
    for job in ("cp2", "pp2_zbv"):
        rows = _rows(tmp_path / job)
        for key in ("loss", "grad_norm", "val_loss"):
            a = [(r["step"], r[key]) for r in single if key in r]
            b = [(r["step"], r[key]) for r in rows if key in r]
            assert a and [s for s, _ in a] == [s for s, _ in b], (job, key)
            for (step, x), (_, y) in zip(a, b):
                assert abs(x - y) <= 1e-10, (job, key, step, x, y)
