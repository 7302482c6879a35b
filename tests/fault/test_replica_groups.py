"""Fault-tolerant replica groups (torchft, titanlike/training/fault_tolerance.py) on CPU, as a cluster runs them.

A lighthouse on loopback (started and stopped here), two replica groups of two gloo ranks each (FSDP2 inside), each
its own real torchrun, float64, checkpoints every 4 steps. One job goes through (one shared timeline, several
tests reading it):

1. one rank of group 1 is killed with SIGKILL before a step drawn at random; group 0 keeps stepping alone; torchrun
   restarts group 1 (``--max-restarts 1``), which fetches group 0's live state through torchft's checkpoint
   transport and rejoins;
2. the lighthouse dies: both groups stop with one line within ``quorum_timeout_seconds``;
3. a new lighthouse, both groups relaunched by hand: they resume from their checkpoints and finish.

At the end both groups' checkpoints (weights and AdamW state) are bitwise equal, and every logged loss and the
final weights equal a float64 single-process reference that replays the same participation: a step with both groups
trains on two group batches, a step group 1 missed on one.
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
from dist_utils import tiny_run_args, unused_port, worker_env

from titanlike.data import asset_path

pytest.importorskip("torchft", reason="the optional extra titanlike[ft] (torchft) is not installed")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("replica_group_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
STEPS = 24
INTERVAL = 4
QUORUM_TIMEOUT = 8
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
        *tiny_run_args(CORPUS),
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(INTERVAL),
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
        "--fault_tolerance.quorum_timeout_seconds",
        str(QUORUM_TIMEOUT),
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
        *env.pop("FT_TEST_EXTRA", "").split(),
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


def _wait_for(path: Path, procs: dict, seconds: float) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path.name} did not appear within {seconds} s"
        assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}
        time.sleep(0.1)


def together(mine: Path, peer: Path) -> dict[str, str]:
    """The worker's environment for a group that starts its first quorum with the other's."""
    return {"FT_TEST_READY": str(mine), "FT_TEST_PEER_READY": str(peer)}


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    """The job of the module docstring; returns what the tests read."""
    tmp = tmp_path_factory.mktemp("replica_groups")
    seed = int(time.time()) % 10_000
    kill_step = random.Random(seed).randint(2, 6)
    print(f"kill before group 1's training step {kill_step} (seed {seed})")
    port = unused_port()
    lighthouse = f"http://127.0.0.1:{port}"
    a, b = tmp / "group0", tmp / "group1"
    ready, ready0, pause = tmp / "group1_ready", tmp / "group0_ready", tmp / "paused"
    out = {"tmp": tmp, "a": a, "b": b, "kill_step": kill_step}
    lh = start_lighthouse(port, tmp / "lighthouse1.log")
    try:
        procs = {
            "group0": start_group(
                a, lighthouse, 0, 0, **together(ready0, ready), FT_TEST_HOLD_FOR=str(ready), FT_TEST_PAUSE=str(pause)
            ),
            "group1": start_group(b, lighthouse, 1, 1, **together(ready, ready0), FT_TEST_KILL=f"{kill_step}:1"),
        }
        t0 = time.time()
        _wait_for(pause, procs, 300)  # group 1 is back and group 0 holds before its next quorum
        out["phase1_seconds"] = time.time() - t0
        os.killpg(lh.pid, 9)
        lh.wait()
        out["lighthouse_killed"] = time.time()
        (tmp / "paused.go").write_text("")
        out["codes1"] = wait_all(procs, timeout=120)
        out["stopped"] = time.time()
        out["logs1"] = {n: (tmp / n / "console.log").read_text() for n in procs}
        out["rows1"] = rows(a)
        ready.unlink(missing_ok=True)
        ready0.unlink(missing_ok=True)
        lh = start_lighthouse(port, tmp / "lighthouse2.log")
        for n in procs:
            (tmp / n / "console.log").rename(tmp / n / "console1.log")
        procs = {
            "group0": start_group(a, lighthouse, 0, 0, **together(ready0, ready)),
            "group1": start_group(b, lighthouse, 1, 0, **together(ready, ready0)),
        }
        out["codes2"] = wait_all(procs, timeout=300)
        out["logs2"] = {n: (tmp / n / "console.log").read_text() for n in procs}
    finally:
        if lh.poll() is None:
            os.killpg(lh.pid, 9)
            lh.wait()
    out["killed"] = float((tmp / "group1_ready.killed").read_text())
    return out


def _tails(logs: dict) -> str:
    return "\n".join(f"--- {n}\n{text[-3000:]}" for n, text in logs.items())


def test_a_killed_group_leaves_the_other_keeps_stepping_and_it_rejoins(timeline):
    logs, ra = timeline["logs1"], timeline["rows1"]
    assert "recovered the live state of step" in logs["group1"], _tails(logs)
    assert "group 1 left" in logs["group0"] and "group 1 joined" in logs["group0"], _tails(logs)
    after = [s for s in sorted(ra) if ra[s]["unix_time"] > timeline["killed"]]
    alone = [s for s in after if ra[s]["participants"] == 1]
    back = next(s for s in after if ra[s]["participants"] == 2)
    assert alone and alone == list(range(after[0], back)), f"group 0 did not keep stepping alone: {after}"
    print(
        f"killed before group 1's step {timeline['kill_step']}: group 0 committed its next step (alone) "
        f"{ra[after[0]]['unix_time'] - timeline['killed']:.2f} s later, {ra[back]['failed_steps']} step(s) not "
        f"committed; {len(alone)} step(s) alone; group 1 back at step {back}, "
        f"{ra[back]['unix_time'] - timeline['killed']:.1f} s after the kill; phase 1 {timeline['phase1_seconds']:.1f} s"
    )


def test_the_lighthouse_dying_stops_both_groups_with_one_line(timeline):
    logs = timeline["logs1"]
    assert timeline["codes1"] == {"group0": 1, "group1": 1}, _tails(logs)
    for n, text in logs.items():
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert errors and all("the lighthouse at" in e and "is down or unreachable" in e for e in errors), (n, errors)
    took = timeline["stopped"] - timeline["lighthouse_killed"]
    assert took < QUORUM_TIMEOUT + 30, took
    print(f"the lighthouse killed: both groups stopped {took:.1f} s later (quorum_timeout_seconds {QUORUM_TIMEOUT})")


def test_both_groups_resume_from_their_checkpoints_and_end_bitwise_equal_to_the_replayed_reference(timeline):
    logs, a, b = timeline["logs2"], timeline["a"], timeline["b"]
    assert timeline["codes2"] == {"group0": 0, "group1": 0}, _tails(logs)
    # group 0 resumes from its checkpoint; group 1 too, or (when it was away at group 0's last save) it starts
    # afresh and recovers group 0's live state
    assert "checkpoint: resumed from" in logs["group0"], _tails(logs)
    assert any(w in logs["group1"] for w in ("checkpoint: resumed from", "recovered the live state")), _tails(logs)
    ra = rows(a)
    assert sorted(ra) == list(range(1, STEPS + 1))
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
    assert any(n == 1 for _, n in participation.values()) and participation[STEPS][1] == 2
    ref_losses, ref_weights = reference(participation, timeline["tmp"] / "reference")
    worst = max(abs(ref_losses[s] - ra[s]["loss"]) for s in ra)
    assert worst < 1e-10, (worst, ref_losses, {s: r["loss"] for s, r in ra.items()})
    for k, v in ref_weights.items():
        assert (fa[f"model.{k}"] - v).abs().max().item() < 1e-10, k
    print(f"{sum(n == 1 for _, n in participation.values())} step(s) of group 0 alone; worst loss diff {worst:.1e}")
    print("step: (first group batch, groups) " + ", ".join(f"{s}: {participation[s]}" for s in participation))
    print("quorum seconds (both groups): " + ", ".join(f"{ra[s]['quorum_seconds']:.3f}" for s in ra if s > 1))


def test_a_group_that_never_comes_back_below_min_replica_size_stops_the_job_with_one_line(tmp_path):
    """min_replica_size = 2 and group 1 never starts: group 0 waits for it quorum_timeout_seconds, then stops (with
    min_replica_size = 1, the default, it trains on alone: the timeline above)."""
    port = unused_port()
    lh = start_lighthouse(port, tmp_path / "lighthouse.log")
    try:
        a = tmp_path / "group0"
        t0 = time.time()
        proc = start_group(
            a,
            f"http://127.0.0.1:{port}",
            0,
            0,
            FT_TEST_EXTRA="--fault_tolerance.min_replica_size 2 --fault_tolerance.quorum_timeout_seconds 4",
        )
        codes = wait_all({"group0": proc}, timeout=200)
        seconds = time.time() - t0
    finally:
        os.killpg(lh.pid, 9)
        lh.wait()
    log = (a / "console.log").read_text()
    assert codes == {"group0": 1}, log[-3000:]
    assert "1 group(s), fewer than group_size 2 at the start: waiting for more (at most 4 s)" in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors and all("fewer than fault_tolerance.min_replica_size = 2" in e for e in errors), errors
    assert not (a / "metrics.jsonl").exists() or "loss" not in (a / "metrics.jsonl").read_text()  # nothing trained
    print(f"group 0 alone below min_replica_size: stopped {seconds:.1f} s after its launch")


LOCAL_STEPS, SYNC = 6, 3


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_semi_sync_groups_agree_at_every_sync_point_and_follow_the_reference(tmp_path, method):
    """semi_sync_method = local_sgd / diloco (torchft's LocalSGD / DiLoCo): each group steps alone on its own group
    batches (group g reads group batch 2(s-1) + g at step s); every SYNC steps the weights are averaged (local_sgd)
    or the outer SGD steps on the averaged pseudo-gradients (diloco). The groups' weights at every sync point are
    bitwise equal, and each group's losses and the final weights equal a float64 reference of two models in one
    process doing the same arithmetic."""
    port = unused_port()
    lh = start_lighthouse(port, tmp_path / "lighthouse.log")
    extra = f"--training.steps {LOCAL_STEPS} --checkpoint.interval {SYNC} --fault_tolerance.semi_sync_method {method}"
    extra += f" --fault_tolerance.sync_steps {SYNC}"
    dumps = [tmp_path / "group0", tmp_path / "group1"]
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    try:
        procs = {
            f"group{g}": start_group(
                dumps[g], f"http://127.0.0.1:{port}", g, 0, **together(ready[g], ready[1 - g]), FT_TEST_EXTRA=extra
            )
            for g in (0, 1)
        }
        codes = wait_all(procs, timeout=300)
    finally:
        os.killpg(lh.pid, 9)
        lh.wait()
    logs = {n: (tmp_path / n / "console.log").read_text() for n in procs}
    assert codes == {"group0": 0, "group1": 0}, _tails(logs)
    from titanlike.checkpoint import committed_checkpoints

    states = {}
    for sync_step in range(SYNC, LOCAL_STEPS + 1, SYNC):
        for g in (0, 1):
            out = dumps[g] / f"state{sync_step}.pt"
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(committed_checkpoints(dumps[g] / "checkpoint")[sync_step], out)
            states[sync_step, g] = torch.load(out, weights_only=False)["model"]
        a, b = states[sync_step, 0], states[sync_step, 1]
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, (sync_step, unequal[:5])
    logged = [rows(d) for d in dumps]
    assert [logged[0][s]["participants"] for s in (SYNC, LOCAL_STEPS)] == [2, 2]
    assert logged[0][1]["loss"] != logged[1][1]["loss"]  # each group trained on its own data
    ref_losses, ref_weights = semi_sync_reference(tmp_path / "reference", method)
    worst = max(abs(ref_losses[g][s] - logged[g][s]["loss"]) for g in (0, 1) for s in logged[g])
    assert worst < 1e-10, worst
    final = states[LOCAL_STEPS, 0]
    assert max((final[k] - v).abs().max().item() for k, v in ref_weights.items()) < 1e-10
    print(f"{method}: groups bitwise equal at steps {list(range(SYNC, LOCAL_STEPS + 1, SYNC))}; worst {worst:.1e}")


def semi_sync_reference(dump: Path, method: str):
    """Two single-process float64 trainers (the two groups), each on its group batches, with AdamW of its own; every
    SYNC steps both models' weights become their mean (local_sgd), or (diloco) the outer weights, a copy of the
    weights at the last sync, take an SGD step (lr 0.7, momentum 0.9, Nesterov) on the mean of the pseudo-gradients
    (outer - local), and both models continue from them."""
    from titanlike.config import load_config
    from titanlike.data import set_loader_position
    from titanlike.training.step import train_step
    from titanlike.training.trainer import Trainer

    argv = train_args(dump, "", 0)
    argv = argv[: argv.index("--fault_tolerance.enable")] + ["--checkpoint.enable", "false"]
    argv += ["--training.steps", str(LOCAL_STEPS), "--training.global_batch_size", str(GROUP_BATCH)]
    trainers = []
    for g in (0, 1):
        cfg = load_config([*argv, "--job.dump_folder", str(dump / f"g{g}")], world_size=1)
        trainers.append(Trainer(cfg))
    params = [list(t.model_parts[0].parameters()) for t in trainers]
    outer = [torch.nn.Parameter(p.detach().clone()) for p in params[0]]
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    losses = {0: {}, 1: {}}
    try:
        for step in range(1, LOCAL_STEPS + 1):
            for g, t in enumerate(trainers):
                set_loader_position(t.dataloader, (2 * (step - 1) + g) * GROUP_BATCH)
                res = train_step(
                    t.model_parts,
                    t.optimizer,
                    t._next_micro_batches(iter(t.dataloader)),
                    t.loss,
                    max_norm=t.cfg.training.max_norm,
                    clip_fn=t.clip_fn,
                    lr_scheduler=t.lr_scheduler,
                )
                losses[g][step] = res.loss
            if step % SYNC == 0 and method == "local_sgd":
                with torch.no_grad():
                    for pa, pb in zip(*params):
                        mean = (pa + pb) / 2
                        pa.copy_(mean)
                        pb.copy_(mean)
            elif step % SYNC == 0:
                with torch.no_grad():
                    for o, pa, pb in zip(outer, *params):
                        o.grad = ((o - pa) + (o - pb)) / 2
                outer_opt.step()
                outer_opt.zero_grad()
                with torch.no_grad():
                    for o, pa, pb in zip(outer, *params):
                        pa.copy_(o)
                        pb.copy_(o)
        weights = {k: v.detach().clone() for k, v in trainers[0].model_parts[0].state_dict().items()}
    finally:
        for t in trainers:
            t.close()
    return losses, weights
