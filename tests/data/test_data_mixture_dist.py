"""A 2-rank run through the real trainer on a weighted mixture of a .parquet source, a .jsonl.gz source and a folder
of .bin shards (made by the preprocessing script's workers), with a Hugging Face tokenizer.json, resumes exactly:
the run restarted from its step-3 checkpoint logs bitwise the losses of the uninterrupted run. On the way: tokens and
epochs per source in metrics.jsonl, the small source's wrap-around logged, a validation loss per source. One launch
(tests/data/data_mixture_worker.py) runs both jobs on forked ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data_files import documents, make_hf_tokenizer, write_jsonl_gz, write_parquet
from dist_utils import worker_env

from titanlike.data import build_tokenizer
from titanlike.data.preprocess import preprocess

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("data_mixture_worker.py")
WEIGHTS = [0.3, 0.5, 0.2]  # web (parquet), c4 (jsonl.gz, small: it runs out), books (.bin shards)
STEPS, GLOBAL, SEQ = 6, 8, 32


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_a_two_rank_mixture_with_a_hf_tokenizer_resumes_bitwise(tmp_path):
    tok_dir = make_hf_tokenizer(tmp_path / "Llama-like")
    docs = documents(260, seed=5)
    web = write_parquet(tmp_path / "web.parquet", docs[:200], row_group_size=40)
    c4 = write_jsonl_gz(tmp_path / "c4.json.gz", docs[200:204])
    raw = tmp_path / "raw"
    raw.mkdir()
    write_parquet(raw / "books.parquet", docs[204:], row_group_size=10)
    r = preprocess([str(raw)], tmp_path / "books", build_tokenizer(str(tok_dir)), workers=2, shard_tokens=2000)
    assert r.problems == [] and r.shards >= 3
    out = tmp_path / "runs"
    argv = [
        "--model.flavor",
        "tiny",
        "--model.tokenizer",
        str(tok_dir),
        "--data.path",
        f"{web};{c4};{tmp_path / 'books'}",
        "--data.weights",
        ",".join(map(str, WEIGHTS)),
        "--data.val_fraction",
        "0.3",
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        str(SEQ),
        "--training.global_batch_size",
        str(GLOBAL),
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--validation.freq",
        "3",
        "--validation.steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--comm.timeout_seconds",
        "60",
    ]
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), "full", "resumed:full:3", "--", *argv],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = "".join(p.read_text()[-3000:] for p in sorted(out.glob("*/rank*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    full, resumed = _rows(out / "full"), _rows(out / "resumed")
    loss = {row["step"]: row["loss"] for row in full if "loss" in row}
    again = {row["step"]: row["loss"] for row in resumed if "loss" in row}
    assert sorted(loss) == list(range(1, STEPS + 1)) and sorted(again) == [4, 5, 6]
    assert all(again[s] == loss[s] for s in again), (loss, again)  # bitwise (float32, the same layout)
    vals = {(row["step"], k): v for row in full + resumed for k, v in row.items() if k.startswith("val_loss")}
    assert {k for _, k in vals} == {"val_loss", "val_loss.web", "val_loss.c4", "val_loss.books"}
    assert vals[(6, "val_loss")] == [row for row in resumed if "val_loss" in row][-1]["val_loss"]
    # per source: tokens trained on (the blend's exact counts) and epochs; the small source wrapped, and said so
    last = [row for row in full if row.get("step") == STEPS and "loss" in row][0]
    tokens = {name: last[f"data.{name}.tokens"] for name in ("web", "c4", "books")}
    assert sum(tokens.values()) == STEPS * GLOBAL * SEQ
    assert all(abs(tokens[n] / (STEPS * GLOBAL * SEQ) - w) <= 1 / (STEPS * GLOBAL) for n, w in zip(tokens, WEIGHTS))
    assert last["data.c4.epochs"] > 1 > last["data.web.epochs"]
    log0 = (out / "full" / "rank0.log").read_text()
    assert "data: mixture of 3 sources: web weight 0.3" in log0 and "books weight 0.2" in log0
    assert "data: source 'c4' ran out in step 3 (all its 12 windows read): epoch 2 follows, in a new order" in log0
    assert "data  web " in log0  # the console summary of the mixture
