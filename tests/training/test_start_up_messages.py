"""What a run says at its start and what a refusal looks like: the data files used and those skipped (with why), a
refusal under torchrun (our line once, the root cause of torchrun's report; the workers exit 2), a layout of several
ranks under plain ``python train.py`` (start it with torchrun)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from dist_utils import unused_port, worker_env

from titanlike.data import asset_path
from titanlike.training.trainer import main

REPO = Path(__file__).resolve().parents[2]
CORPUS = asset_path("corpus", "tinyshakespeare.txt")
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--validation.enable", "false"]


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    (folder / "drafts").mkdir(parents=True)
    (folder / "play.txt").write_text(CORPUS.read_text())
    for name in ("notes.md", "README.md", "chapter1.text", "chapter2.text"):
        (folder / name).write_text("words that are never read\n")
    return folder


def test_a_folder_says_which_files_it_reads_and_which_it_skips(tmp_path, capsys):
    folder = _folder(tmp_path)
    argv = [*TINY, "--training.steps", "1", "--data.path", str(folder), "--job.dump_folder", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("data: ")]
    assert lines == [
        f"data: {folder}: 1 file (play.txt), 5 skipped (README.md (.md: no reader), chapter1.text (.text: no "
        f"reader), chapter2.text (.text: no reader), drafts (a folder: not recursed) and 1 more); read: .jsonl.gz, "
        f".json.gz, .jsonl.zst, .json.zst, .jsonl, .parquet, .txt, .bin (rename a text file to .txt to train on it)"
    ], out
    # too little data left after the skips: the refusal names them too
    (folder / "play.txt").write_text("a few words\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fewer than one window" in err and "5 skipped (README.md" in err, err


def test_the_shipped_corpus_is_named_as_such(tmp_path, capsys):
    assert main([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "data: the shipped corpus (tinyshakespeare.txt and 13 books of Project Gutenberg" in out, out


def test_a_refusal_under_torchrun_is_our_line_once_and_the_root_cause_of_its_report(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(unused_port())),
            "train.py",
            *TINY,
            "--parallelism.tensor_parallel_degree",
            "3",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - t0
    line = (
        "error: 3 problems: (1) parallelism: world size 2 is not divisible by tp 3 x pp 1 x cp 1 x dp_replicate 1 = 3; "
        "change the degrees or the number of processes; (2) parallelism.tensor_parallel_degree 3 does not divide "
        "n_heads 4; choose a tp degree dividing 4; (3) parallelism.tensor_parallel_degree 3 does not divide n_kv_heads "
        "2; choose a tp degree dividing 2"
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text  # torchrun's own code for a failed worker
    assert proc.stderr.splitlines()[0] == line, text
    assert [ln for ln in text.splitlines() if ln == line] == [line], text  # printed once
    root = text.split("Root Cause (first observed failure):")[1]
    assert re.search(r"exitcode\s*: 2 ", root) and f"traceback : {line}" in root, text
    assert "To enable traceback" not in root
    print(f"torchrun refusal: {len(text.splitlines())} lines, {seconds:.1f}s")


def test_the_launcher_ends_with_our_line_and_the_worker_exit_code(tmp_path):
    """python train.py --nproc_per_node N: a layout refusal before any worker starts, a refusal a worker finds (a
    latin-1 data file) and a good run: our line only, exit 2 / 2 / 0 (torchrun itself: its report and exit 1)."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 200)
    runs = {}
    for name, extra in {
        "layout": ["--parallelism.tensor_parallel_degree", "3"],
        "data": ["--data.path", str(latin)],
        "good": ["--training.steps", "2"],
    }.items():
        runs[name] = subprocess.run(
            [
                sys.executable,
                "train.py",
                "--nproc_per_node",
                "2",
                *TINY,
                *extra,
                "--job.dump_folder",
                str(tmp_path / name),
            ],
            cwd=REPO,
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    layout, data, good = runs["layout"], runs["data"], runs["good"]
    assert layout.returncode == 2 and layout.stdout == "", layout.stderr
    assert layout.stderr.splitlines() == [layout.stderr.strip()] and layout.stderr.startswith("error: 3 problems: (1)")
    assert not (tmp_path / "layout").exists()  # nothing started
    assert data.returncode == 2, data.stdout + data.stderr
    assert data.stderr.strip().splitlines() == [data.stderr.strip()], data.stderr  # the worker's line, nothing else
    assert data.stderr.startswith("error: data.path: 1 bad input:") and "is not UTF-8" in data.stderr
    assert good.returncode == 0, good.stderr[-3000:]
    assert "step     2" in good.stdout and "ChildFailedError" not in good.stdout + good.stderr


def test_python_train_py_with_a_layout_of_several_ranks_suggests_torchrun(tmp_path, capsys):
    args = [*TINY, "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]
    assert main([*args, "--job.dump_folder", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "error: parallelism: this layout needs 4 processes and python train.py is one; start it with "
        "torchrun --nproc_per_node=4 train.py and the same options\n"
    )


def test_the_step_line_the_summary_and_nothing_to_do(tmp_path, capsys):
    """Each step line has tokens/s per device and the step time; the run ends with a summary; the same command on a
    finished run says there is nothing to do."""
    import json

    argv = [*TINY, "--training.steps", "3", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert steps and all(re.search(r"tok/s +\d+ \(\d+/device\)  step +\d+\.\d{3}s", ln) for ln in steps), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"done: steps 1-3 \(3\) in 0:\d\d, \d+\.\d{{3}}s per step, [\d,]+ tok/s \([\d,]+/device\); loss "
        rf"\d\.\d{{4}} -> \d\.\d{{4}}; checkpoint {re.escape(str(tmp_path / 'checkpoint' / 'step-3'))}",
        last,
    ), last
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_time_s"] > 0 for r in rows if "loss" in r)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "nothing to do: the run is at step 3 and training.steps is 3; raise training.steps to train further" in out
    assert "done:" not in out


def test_the_pipeline_line_names_the_schedule_stages_and_microbatches():
    from types import SimpleNamespace

    from titanlike.config import load_config
    from titanlike.training.trainer import Trainer

    argv = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
    cfg = load_config([*argv, "Interleaved1F1B", "--training.global_batch_size", "16"], world_size=4)
    pp = SimpleNamespace(schedule_name="Interleaved1F1B", num_stages=4, stage_ids=[0, 2])
    stub = SimpleNamespace(cfg=cfg, pp=pp, dims=SimpleNamespace(pp=2))
    assert Trainer._pipeline_note(stub) == (
        "Interleaved1F1B, 4 stages over pp 2 ranks (2 per rank; rank 0 holds stages 0, 2), 8 microbatches of 1 "
        "sequence per pass"
    )
