"""The silent-corruption sentinel (``training.sdc_check_interval``, titanlike/training/sentinel.py) on CPU: one bit
flipped in one rank's weight, right after step 3, is named (rank, tensor, step) at the check of step 4, and the run
stops before saving step 4: the step-2 checkpoint is the newest. One shared launch (sentinel_worker.py) runs every
job of forked ranks one after the other: a clean HSDP run, a bit flipped in one HSDP replica (two replicas: both are
named; three: the odd one), in one tp rank's norm, in the last stage's copy of GPT-2's tied embedding. The torchft
replica groups (three groups of one rank, a lighthouse on loopback) are a second launch.

Numbers of the clean run (a check's seconds and bytes, the latter equal to the planner's price) are printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import tiny_run_args, unused_port, worker_env

from titanlike.checkpoint import committed_checkpoints
from titanlike.config import load_config
from titanlike.data import asset_path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sentinel_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))

COMMON = [
    "--model.flavor",
    "tiny",
    "--training.device",
    "cpu",
    "--training.steps",
    "6",
    *tiny_run_args(CORPUS),
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.exit_signals",
    "",
    "--training.sdc_check_interval",
    "2",
    "--comm.timeout_seconds",
    "60",
]

# name -> (world size, flip "RANK/STEP/PARAM/BIT" or "-", extra options)
JOBS = {
    "hsdp": (2, "-", ["--parallelism.data_parallel_replicate_degree", "2"]),
    "hsdp_flip": (2, "1/3/layers.0.attention.wq.weight/20", ["--parallelism.data_parallel_replicate_degree", "2"]),
    "hsdp3_flip": (3, "2/3/output.weight/30", ["--parallelism.data_parallel_replicate_degree", "3"]),
    "tp_flip": (2, "1/3/norm.weight/12", ["--parallelism.tensor_parallel_degree", "2"]),
    "pp_tied_flip": (
        2,
        "1/3/output.weight/5",
        ["--model.name", "gpt2", "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sentinel")
    for name, (_, _, extra) in JOBS.items():
        (out / f"{name}.args").write_text("\n".join(extra))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), *(f"{n}={w}:{f}" for n, (w, f, _) in JOBS.items()), "--", *COMMON],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"the shared launch took {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def logs(dump: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(dump.glob("rank*.log")))


def error_lines(dump: Path) -> list[str]:
    return [ln for ln in logs(dump).splitlines() if ln.startswith("error: ")]


def checkpoints(dump: Path) -> list[int]:
    return list(committed_checkpoints(dump / "checkpoint"))


def check_rows(dump: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "sdc_check_bytes" in r]


def planner_price(name: str) -> int:
    from titanlike.config import model_args_from_config
    from titanlike.data import build_tokenizer
    from titanlike.planner.layout import Layout
    from titanlike.planner.sentinel import sdc_price

    world, _, extra = JOBS[name]
    cfg = load_config([*COMMON, *extra], world_size=world)
    args = model_args_from_config(cfg, build_tokenizer(cfg.model.tokenizer).vocab_size)
    lo = Layout.from_config(cfg, world, args, 8)
    return sdc_price(cfg, lo, args, 0).bytes


def test_a_clean_run_passes_every_check_and_its_cost_is_the_planners_price(runs):
    dump = runs / "hsdp"
    assert json.loads((dump / "codes.json").read_text()) == [0, 0], logs(dump)[-3000:]
    assert checkpoints(dump) == [2, 4, 6]
    rows = check_rows(dump)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert all(r["sdc_check_tensors"] == 63 for r in rows)  # 21 parameters and their two AdamW moments
    assert {r["sdc_check_bytes"] for r in rows} == {planner_price("hsdp")}
    assert "sdc: step 2: 63 tensors identical across the HSDP replicas (dp_replicate)" in logs(dump)
    for name in ("tp_flip", "pp_tied_flip"):  # their step-2 checks passed, at the planner's price
        (row,) = check_rows(runs / name)
        assert row["step"] == 2 and row["sdc_check_bytes"] == planner_price(name), name
    print("sdc check, HSDP 2 ranks:", [(r["sdc_check_seconds"], r["sdc_check_bytes"]) for r in rows])


@pytest.mark.parametrize(
    "name,tensor,where,blame",
    [
        (
            "hsdp_flip",
            "parameter 'layers.0.attention.wq.weight'",
            "the HSDP replicas (dp_replicate) [rank 0, rank 1]",
            "rank 0 and rank 1 disagree (two copies cannot say which is wrong)",
        ),
        (
            "hsdp3_flip",
            "parameter 'output.weight'",
            "the HSDP replicas (dp_replicate) [rank 0, rank 1, rank 2]",
            "rank 2 differs from the other 2",
        ),
        (
            "tp_flip",
            "parameter 'norm.weight'",
            "the tensor-parallel ranks (tp) [rank 0, rank 1]",
            "rank 0 and rank 1 disagree",
        ),
        (
            "pp_tied_flip",
            "parameter 'tok_embeddings.weight'",
            "the copies of a weight tied across pipeline stages [rank 0, rank 1]",
            "rank 0 and rank 1 disagree",
        ),
    ],
)
def test_one_flipped_bit_is_named_at_the_next_check_and_never_saved(runs, name, tensor, where, blame):
    dump = runs / name
    world = JOBS[name][0]
    flipped = json.loads((dump / "flipped").read_text())
    assert flipped["step"] == 3 and flipped["before"] != flipped["after"]
    assert json.loads((dump / "codes.json").read_text()) == [1] * world, logs(dump)[-3000:]
    lines = error_lines(dump)
    assert len(lines) == world and len(set(lines)) == 1, lines  # every rank stops with the same line
    line = lines[0]
    assert line.startswith("error: silent data corruption found at step 4: "), line
    assert f"{tensor} differs across {where}: {blame}" in line, line
    assert "the run stops before saving step 4 (the newest checkpoint, step 2, is kept" in line, line
    assert checkpoints(dump) == [2]  # step 4 was due: not written
    assert not list((dump / "checkpoint").glob("step-4*"))
    print(line)


# ---------------------------------------------------------------------------------------------- torchft groups
GROUPS = 3


def test_a_flipped_bit_in_one_torchft_replica_group_is_named_and_never_saved(tmp_path):
    pytest.importorskip("torchft", reason="the optional extra titanlike[ft] (torchft) is not installed")
    exe = shutil.which("torchft_lighthouse")
    assert exe, "torchft's torchft_lighthouse binary is not on PATH"
    port = unused_port()
    lighthouse = subprocess.Popen(
        [exe, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "20000"]
        + ["--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "20000"],
        stdout=open(tmp_path / "lighthouse.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    procs = {}
    try:
        for g in range(GROUPS):
            dump = tmp_path / f"group{g}"
            dump.mkdir()
            env = {"SDC_DUMP": str(dump), **({"SDC_FLIP": "0/3/layers.1.feed_forward.w2.weight/17"} if g == 2 else {})}
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{unused_port()}",
                "--monitor-interval",
                "0.5",
                str(WORKER),
                "--main",
                *COMMON,
                "--job.dump_folder",
                str(dump),
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size",
                str(GROUPS),
                "--fault_tolerance.replica_id",
                str(g),
                "--fault_tolerance.lighthouse",
                f"http://127.0.0.1:{port}",
                "--fault_tolerance.quorum_timeout_seconds",
                "60",
                "--fault_tolerance.min_replica_size",  # every step with all three (a loaded machine splits quorums)
                str(GROUPS),
            ]
            procs[g] = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=worker_env(RUST_LOG="warn", **env),
                stdout=open(dump / "console.log", "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.time() + 300
        codes = {g: p.wait(timeout=max(1.0, deadline - time.time())) for g, p in procs.items()}
    finally:
        for p in [*procs.values(), lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    consoles = {g: (tmp_path / f"group{g}" / "console.log").read_text() for g in procs}
    assert all(c != 0 for c in codes.values()), consoles
    for g, text in consoles.items():
        lines = [ln for ln in text.splitlines() if "error: silent data corruption" in ln]
        assert lines, text[-3000:]
        line = lines[0]
        assert (
            "found at step 4: parameter 'layers.1.feed_forward.w2.weight' differs across the torchft replica " in line
        )
        assert "replica group 2 differs from the other 2" in line, line
        assert checkpoints(tmp_path / f"group{g}") == [2], g
    print(line)


# ---------------------------------------------------------------------------------------------- the fingerprint
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int64"])
def test_every_single_flipped_bit_changes_the_fingerprint(dtype):
    import torch

    from titanlike.parallel.replica_check import fingerprint

    torch.manual_seed(0)
    base = (torch.randn(7, 5) * 100).to(getattr(torch, dtype))
    words = {8: torch.int64, 4: torch.int32, 2: torch.int16}[base.element_size()]
    ref = fingerprint(base)
    bits = base.element_size() * 8
    for i in range(base.numel()):
        for b in range(bits):
            u = base.clone()
            w = u.view(-1).view(words)
            w[i] ^= (1 << b) if b < bits - 1 else -(1 << b)  # the sign bit too
            assert not torch.equal(fingerprint(u), ref), (i, b)
    # a view that starts between two int64 words, and one of an odd byte count: the same numbers as a copy
    flat = base.reshape(-1)
    for view in (flat[1:9], flat[1:4]):
        assert torch.equal(fingerprint(view), fingerprint(view.clone()))
