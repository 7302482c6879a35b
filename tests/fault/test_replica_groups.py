"""Fault-tolerant replica groups (torchft, titanlike/training/fault_tolerance.py) on CPU, as a cluster runs them.

A lighthouse on loopback (started and stopped here), two replica groups of two gloo ranks each (FSDP2 inside), each
its own real torchrun, float64. One rank of group 1 is killed with SIGKILL at a step drawn at random; group 0 keeps
stepping alone; torchrun restarts group 1 (``--max-restarts 1``), which fetches group 0's live state through
torchft's checkpoint transport and rejoins. At the end both groups' checkpoints (weights and AdamW state) are
bitwise equal, and every logged loss and the final weights equal a float64 single-process reference that replays
the same participation: a step with both groups trains on two group batches, a step group 1 missed on one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import unused_port, worker_env

from titanlike.data import asset_path

pytest.importorskip("torchft", reason="the optional extra titanlike[ft] (torchft) is not installed")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("replica_group_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
STEPS = 20
GROUP_BATCH = 4  # two ranks x local batch 2


def train_args(dump: Path, lighthouse: str, replica_id: int) -> list[str]:
    return [
        "--model.flavor",
        "tiny",
        "--training.dtype",
        "float64",
        "--training.device",
        "cpu",
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(STEPS),
        "--checkpoint.exit_signals",
        "",
        "--comm.timeout_seconds",
        "60",
        "--job.dump_folder",
        str(dump),
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        "2",
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--fault_tolerance.lighthouse",
        lighthouse,
        "--fault_tolerance.process_group_timeout_ms",
        "5000",
    ]


def start_lighthouse(port: int, log: Path) -> subprocess.Popen:
    exe = shutil.which("torchft_lighthouse")
    assert exe, "torchft's torchft_lighthouse binary is not on PATH"
    proc = subprocess.Popen(
        [
            exe,
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{port}",
            "--join_timeout_ms",
            "1000",
            "--quorum_tick_ms",
            "50",
            "--heartbeat_timeout_ms",
            "2000",
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc


def start_group(dump: Path, lighthouse: str, replica_id: int, restarts: int, **env: str) -> subprocess.Popen:
    dump.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{unused_port()}",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(WORKER),
        *train_args(dump, lighthouse, replica_id),
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=worker_env(RUST_LOG="warn", **env),
        stdout=open(dump / "console.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def rows(dump: Path) -> dict[int, dict]:
    """The metrics.jsonl rows of the training steps, by step (a restarted group's rows overwrite its first
    attempt's)."""
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out


def final_state(dump: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from titanlike.checkpoint import committed_checkpoints

    step_dir = committed_checkpoints(dump / "checkpoint")[STEPS]
    out = dump / "final.pt"
    dcp_to_torch_save(step_dir, out)
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v

    walk("", state)
    return flat


def reference(participation: dict[int, tuple[int, int]], dump: Path) -> tuple[dict[int, float], dict]:
    """One process, float64, no fault tolerance: step s trains on the group batches participation[s] = (first,
    count) of the same global sample stream (the same seed and data order), as one global batch."""
    from titanlike.config import load_config
    from titanlike.data import set_loader_position
    from titanlike.training.step import train_step
    from titanlike.training.trainer import Trainer

    argv = train_args(dump, "", 0)
    cut = argv.index("--fault_tolerance.enable")
    argv = argv[:cut] + ["--checkpoint.enable", "false", "--training.global_batch_size", str(GROUP_BATCH)]
    cfg = load_config(argv, world_size=1)
    t = Trainer(cfg)
    losses = {}
    try:
        for step in sorted(participation):
            first, count = participation[step]
            mbs = []
            for b in range(first, first + count):
                set_loader_position(t.dataloader, b * GROUP_BATCH)
                mbs += t._next_micro_batches(iter(t.dataloader))
            res = train_step(
                t.model_parts,
                t.optimizer,
                mbs,
                t.loss,
                max_norm=cfg.training.max_norm,
                clip_fn=t.clip_fn,
                lr_scheduler=t.lr_scheduler,
            )
            losses[step] = res.loss
        weights = {k: v.detach().clone() for k, v in t.model_parts[0].state_dict().items()}
    finally:
        t.close()
    return losses, weights


def wait_all(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    deadline = time.time() + timeout
    codes = {}
    try:
        for name, p in procs.items():
            codes[name] = p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return codes


def test_a_killed_group_rejoins_bitwise_and_the_losses_replay_the_participation(tmp_path):
    seed = int(time.time()) % 10_000
    kill_step = random.Random(seed).randint(2, 7)
    print(f"kill step {kill_step} (seed {seed})")
    port = unused_port()
    lighthouse = f"http://127.0.0.1:{port}"
    lh = start_lighthouse(port, tmp_path / "lighthouse.log")
    ready = tmp_path / "group1_ready"
    try:
        a, b = tmp_path / "group0", tmp_path / "group1"
        procs = {
            "group0": start_group(a, lighthouse, 0, 0, FT_TEST_WAIT_FOR=str(ready)),
            "group1": start_group(b, lighthouse, 1, 1, FT_TEST_READY=str(ready), FT_TEST_KILL=f"{kill_step}:1"),
        }
        t0 = time.time()
        codes = wait_all(procs, timeout=400)
        seconds = time.time() - t0
    finally:
        os.killpg(lh.pid, 9)
        lh.wait()
    logs = {n: (tmp_path / n / "console.log").read_text() for n in procs}
    assert codes == {"group0": 0, "group1": 0}, f"{codes}\n{logs['group0'][-3000:]}\n{logs['group1'][-3000:]}"
    ra, rb = rows(a), rows(b)
    assert sorted(ra) == list(range(1, STEPS + 1))
    # group 0 never stopped: some step trained without group 1, and group 1 came back and recovered
    alone = [s for s, r in ra.items() if r["participants"] == 1]
    assert alone, f"group 0 never stepped alone: {[(s, r['participants']) for s, r in ra.items()]}"
    assert ra[STEPS]["participants"] == 2, "group 1 did not rejoin before the end"
    assert "recovered the live state of step" in logs["group1"] and "group 1 left" in logs["group0"]
    assert "group 1 joined" in logs["group0"]
    # the steps both trained: the same loss, bitwise
    both = [s for s in rb if rb[s]["participants"] == 2 and ra[s]["participants"] == 2]
    assert both and all(ra[s]["loss"] == rb[s]["loss"] for s in both)
    # final state (weights and AdamW moments): bitwise equal across the groups
    fa, fb = final_state(a), final_state(b)
    assert fa.keys() == fb.keys() and any(k.startswith("optimizer") for k in fa)
    unequal = [k for k in fa if not torch.equal(fa[k], fb[k])]
    assert not unequal, unequal[:5]
    # the participation replayed in one process: each step's group batches [committed before, committed after)
    participation, committed = {}, 0
    for s in range(1, STEPS + 1):
        r = ra[s]
        participation[s] = (r["data_group_batches"] - r["participants"], r["participants"])
        assert participation[s][0] == committed, f"step {s} did not start at the next unread group batch"
        committed = r["data_group_batches"]
    ref_losses, ref_weights = reference(participation, tmp_path / "reference")
    worst = max(abs(ref_losses[s] - ra[s]["loss"]) for s in ra)
    assert worst < 1e-10, (worst, ref_losses, {s: r["loss"] for s, r in ra.items()})
    for k, v in ref_weights.items():
        got = fa[f"model.{k}"]
        assert (got - v).abs().max().item() < 1e-10, k
    killed = float((tmp_path / "group1_ready.killed").read_text())
    after = [s for s in sorted(ra) if ra[s]["unix_time"] > killed]
    back = next(s for s in after if ra[s]["participants"] == 2)
    print(
        f"killed before group 1's step {kill_step}: group 0 committed its next step (alone) "
        f"{ra[after[0]]['unix_time'] - killed:.2f} s later, {ra[STEPS]['failed_steps']} step(s) not committed; "
        f"group 0 stepped alone {len(alone)} step(s); group 1 back at step {back}, "
        f"{ra[back]['unix_time'] - killed:.1f} s after the kill (recovery transfer {rb[back]['recovery_seconds']:.2f} "
        f"s); job {seconds:.1f} s, worst loss difference {worst:.1e}"
    )
