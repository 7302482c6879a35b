"""Resharding cases for tests/test_checkpoint_dist.py: save under one layout, resume under another, in one launch.

    python tests/checkpoint_dist_worker.py OUT_DIR

Forks 4 processes once and runs every case of ``CASES`` in order through the real ``Trainer`` (float64, 6 steps,
global batch 8): a case of n ranks runs on processes 0..n-1 with WORLD_SIZE=n and a process group of its own
(n = 1: a plain single process), the other processes wait for it. A ``resume_from`` case starts from a copy of that
case's ``step-3``. Rank 0 of every case writes ``OUT_DIR/<case>.json`` with the losses; a process that fails
writes ``OUT_DIR/error_rank<r>.txt`` and the launcher stops the others. Per-rank logs: ``OUT_DIR/log_rank<r>.txt``.

The processes meet between cases in a TCPStore hosted by process 0 on a socket the launcher bound before forking:
the launcher itself starts no thread (a store server's thread would be forked mid-lock now and then, and a child
would hang on that lock forever).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from dist_utils import before_step, poke_tensor_value, unused_port

PROCS = 4
SAVE_STEP = 3
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
TIED = ["--model.tie_embeddings", "true", "--model.n_layers", "4", "--training.local_batch_size", "4"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
ZERO1 = ["--parallelism.distributed_optimizer", "--parallelism.data_parallel_replicate_degree", "2"]
ZBV = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]
GPT2 = ["--model.name", "gpt2"]  # tied embeddings, fused c_attn (chunk-sharded under TP)
QWEN3 = ["--model.name", "qwen3"]  # tied embeddings, per-head q/k norms (replicated, gradients summed over tp)
SP = ["--parallelism.enable_sequence_parallel"]
SEED = ["--checkpoint.create_seed_checkpoint", "--checkpoint.checksum"]
ONE_STEP = ["--training.steps", "1"]
MUON = [
    "--optimizer.name",
    "Muon",
]  # torch's defaults (bfloat16 Newton-Schulz): momentum buffers sharded like the weights


def from_seed(case: str) -> list[str]:
    """Start from the seed checkpoint written by ``case`` (``{out}`` is the output folder)."""
    return ["--checkpoint.initial_load_path", f"{{out}}/{case}/checkpoint/step-0"]


# (name, ranks, extra train.py options, the case whose step-3 it resumes from)
CASES = [
    ("tp2_fsdp2", 4, TP2, None),
    ("fsdp4", 4, [], None),
    ("fsdp4_from_tp2_fsdp2", 4, [], "tp2_fsdp2"),
    ("pp2_fsdp2", 4, PP2, None),
    ("pp2_fsdp2_from_tp2_fsdp2", 4, PP2, "tp2_fsdp2"),
    # saved in the background while training goes on, with checksums (hashed in the background thread too)
    ("fsdp2", 2, ["--checkpoint.async_mode", "async", "--checkpoint.checksum"], None),
    ("single", 1, [], None),
    ("single_from_fsdp2", 1, [], "fsdp2"),
    ("tp2", 2, TP2, None),
    # ZeRO-1 (AdamW's moments sharded over the replicated ranks): saved at dp 2, resumed in one process; an fsdp2
    # checkpoint resumed under ZeRO-1
    ("zero1_dp2", 2, ZERO1, None),
    ("single_from_zero1_dp2", 1, [], "zero1_dp2"),
    ("zero1_dp2_from_fsdp2", 2, ZERO1, "fsdp2"),
    ("tp2_from_fsdp2", 2, TP2 + ["--checkpoint.checksum"], "fsdp2"),  # each rank verifies the entries it reads
    # step-6 is there too, with one weight changed in rank 0's data file: set aside, step-3 resumes
    ("tp2_from_corrupt_fsdp2", 2, TP2 + ["--checkpoint.checksum", "--checkpoint.on_corrupt", "previous"], "fsdp2"),
    # context parallel, through the real trainer: cp 2 trains like one process; saved at cp 2 it resumes at cp 1
    # (one process), and a cp 1 checkpoint (fsdp 2) resumes at cp 2
    ("cp2", 2, CP2, None),
    ("single_from_cp2", 1, [], "cp2"),
    ("cp2_from_fsdp2", 2, CP2, "fsdp2"),
    ("tied_fsdp2", 2, TIED, None),
    # V placement: pp rank 0 holds the first stage (embedding) and the last (head), each with its copy of the tied
    # weight; the non-pipelined checkpoint has one optimizer state for both, saved as tok_embeddings.weight.
    ("tied_zbv_pp2", 2, TIED + ZBV, None),
    ("tied_zbv_pp2_from_tied_fsdp2", 2, TIED + ZBV, "tied_fsdp2"),
    # GPT-2: saved under tp2 x fsdp2 (c_attn chunk-sharded, FSDP on its dim 1), resumed in one process.
    ("gpt2_tp2_fsdp2", 4, GPT2 + TP2, None),
    ("gpt2_single", 1, GPT2, None),
    ("gpt2_single_from_gpt2_tp2_fsdp2", 1, GPT2, "gpt2_tp2_fsdp2"),
    # Qwen3 through the real trainer: saved under tp2+SP x fsdp2, resumed in one process.
    ("qwen3_tp2_sp_fsdp2", 4, QWEN3 + TP2 + SP, None),
    ("qwen3_single", 1, QWEN3, None),
    ("qwen3_single_from_qwen3_tp2_sp_fsdp2", 1, QWEN3, "qwen3_tp2_sp_fsdp2"),
    # Seed checkpoints written by the real layout (each rank its shards: one process, tp2 x fsdp2, pp2 x tp2), then
    # loaded (before any step, each rank records the full weights it holds) into one process and into pp2 x fsdp2.
    ("seed_single", 1, SEED, None),
    ("seed_tp2_fsdp2", 4, TP2 + SEED, None),
    ("seed_pp2_tp2", 4, PP2 + TP2 + SEED, None),
    # tied embeddings under V placement: pp rank 0 holds both copies of the tied weight, and writes them once
    ("seed_tied_single", 1, TIED + SEED, None),
    ("seed_tied_zbv_pp2", 2, TIED + ZBV + SEED, None),
    ("single_from_seed_tp2_fsdp2", 1, ONE_STEP + from_seed("seed_tp2_fsdp2"), None),
    ("pp2_fsdp2_from_seed_pp2_tp2", 4, PP2 + ONE_STEP + from_seed("seed_pp2_tp2"), None),
    # Exit signals (SIGNALS): the step is saved and the job stops; "_again" runs the same command into the same
    # folders, which resumes at that step.
    ("sig_tp2_fsdp2", 4, TP2, None),
    ("sig_tp2_fsdp2_again", 4, TP2, None),
    ("sig_pp2_fsdp2", 4, PP2, None),
    ("sig_pp2_fsdp2_again", 4, PP2, None),
    # Muon: tp2 x fsdp2 trains like one process; its checkpoint (momentum buffers) resumes in one process.
    ("muon_tp2_fsdp2", 4, MUON + TP2, None),
    ("muon_single", 1, MUON, None),
    ("muon_single_from_muon_tp2_fsdp2", 1, MUON, "muon_tp2_fsdp2"),
]
# Layout-invariant training (float32 and bfloat16, V 4 virtual ranks of one microbatch of 2): fsdp4 trains bit for
# bit like one process, and its step-3 resumed on fsdp2 and on one process continues the same bits.
INV = ["--training.layout_invariant", "true", "--training.virtual_dp_degree", "4", "--training.dtype", "float32"]
INV_BF16 = [*INV[:-1], "bfloat16"]
CASES += [
    ("inv_fsdp4", 4, INV, None),
    ("inv_single", 1, INV, None),
    ("inv_fsdp2_from_inv_fsdp4", 2, INV, "inv_fsdp4"),
    ("inv_single_from_inv_fsdp4", 1, INV, "inv_fsdp4"),
    ("inv_bf16_fsdp4", 4, INV_BF16, None),
    ("inv_bf16_single", 1, INV_BF16, None),
    ("inv_bf16_fsdp2_from_inv_bf16_fsdp4", 2, INV_BF16, "inv_bf16_fsdp4"),
]
# case -> (the step during which the signal arrives, the ranks that get it)
SIGNALS = {"sig_tp2_fsdp2": (2, (3,)), "sig_pp2_fsdp2": (4, (0, 1, 2, 3))}


def train_args(out: Path, name: str, extra: list[str]) -> list[str]:
    from titanlike.data import asset_path

    return [
        "--model.flavor",
        "tiny",
        "--training.dtype",
        "float64",
        "--training.steps",
        "6",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--data.path",
        str(asset_path("corpus", "tinyshakespeare.txt")),
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "100",
        "--lr_scheduler.warmup_steps",
        "2",
        "--comm.timeout_seconds",
        "60",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(SAVE_STEP),
        "--job.dump_folder",
        str(out / name.removesuffix("_again")),
        *(a.format(out=out) for a in extra),
    ]


def _barrier(store, key: str) -> None:
    store.add(key, 1)
    while int(store.add(key, 0)) < PROCS:
        time.sleep(0.01)


def _record_tied_states_on_load(trainer, record: dict) -> None:
    """After the load, on a rank holding both copies of the tied weight, compare their AdamW states."""
    import torch

    load = trainer.checkpointer.load

    def load_and_record():
        step = load()
        emb = [m.tok_embeddings.weight for m in trainer.model_parts if m.tok_embeddings is not None]
        head = [m.output.weight for m in trainer.model_parts if m.output is not None]
        if emb and head:
            a, b = trainer.optimizer.state[emb[0]], trainer.optimizer.state[head[0]]
            record["tied_state_keys"] = sorted(b)
            record["tied_state_equal"] = all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
            record["tied_exp_avg_norm"] = float(b["exp_avg"].norm())
        return step

    trainer.checkpointer.load = load_and_record


def _record_loaded_weights(trainer, path: Path) -> None:
    """After the load (before any step): the full weights this rank holds (DTensors gathered), into ``path``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from titanlike.checkpoint import merged_model

    load = trainer.checkpointer.load

    def load_and_record():
        step = load()
        sd = get_model_state_dict(merged_model(trainer.model_parts))
        torch.save(
            {
                "meta_init": trainer.meta_init,
                "weights": {
                    k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()
                },
            },
            path,
        )
        return step

    trainer.checkpointer.load = load_and_record


def _run_cases(rank: int, store, out: Path) -> None:
    import torch

    from titanlike.config import load_config
    from titanlike.training.exit_signals import Preempted
    from titanlike.training.trainer import Trainer

    torch.set_num_threads(1)
    for i, (name, n, extra, source) in enumerate(CASES):
        if rank == 0:
            if source is not None:
                src = out / source / "checkpoint" / f"step-{SAVE_STEP}"
                shutil.copytree(src, out / name / "checkpoint" / src.name)
                if "corrupt" in name:
                    newest = shutil.copytree(src.with_name("step-6"), out / name / "checkpoint" / "step-6")
                    # one weight on rank 0's data file changed (rank 1 of the tp2 resume reads that shard too)
                    assert poke_tensor_value(newest, "model.layers.1.feed_forward.w2.weight", 1000.0, 5) == (
                        "__0_0.distcp"
                    )
            store.set(f"port/{i}", str(unused_port()))
        _barrier(store, f"start/{i}")
        if rank < n:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=store.get(f"port/{i}").decode(),
            )
            print(f"=== case {name} (rank {rank} of {n})", flush=True)
            trainer = Trainer(load_config(train_args(out, name, extra), world_size=n))
            tied = {}
            if "tied" in name and source is not None:
                _record_tied_states_on_load(trainer, tied)
            if "_from_seed" in name:
                _record_loaded_weights(trainer, out / f"{name}.rank{rank}.pt")
            import titanlike.training.trainer as trainer_module

            train_step = trainer_module.train_step
            if name in SIGNALS and rank in SIGNALS[name][1]:
                before_step(SIGNALS[name][0], lambda: os.kill(os.getpid(), signal.SIGTERM))
            try:
                losses, preempted = trainer.train(), None
            except Preempted as e:
                losses, preempted = e.losses, e.step
            trainer_module.train_step = train_step
            resumed_at = trainer.checkpointer.plan.step
            trainer.close()
            if rank == 0:
                record = {"losses": losses, "resumed_at": resumed_at, "preempted": preempted, **tied}
                (out / f"{name}.json").write_text(json.dumps(record))
        _barrier(store, f"end/{i}")


def _proc_main(rank: int, listener: socket.socket, out: Path) -> None:
    code = 1
    log = open(out / f"log_rank{rank}.txt", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        import torch.distributed as dist

        port = listener.getsockname()[1]
        timeout = datetime.timedelta(seconds=300)
        if rank == 0:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                PROCS,
                is_master=True,
                master_listen_fd=listener.fileno(),
                wait_for_workers=False,
                timeout=timeout,
            )
        else:
            listener.close()
            store = dist.TCPStore("127.0.0.1", port, PROCS, is_master=False, timeout=timeout)
        _run_cases(rank, store, out)
        _barrier(store, "exit")  # the store lives in process 0: it leaves last
        if rank == 0:
            while int(store.add("left", 0)) < PROCS - 1:
                time.sleep(0.01)
        else:
            store.add("left", 1)
        code = 0
    except BaseException:  # noqa: BLE001 - report anything, then leave at once
        (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: with it, importing torch starts no thread
    import titanlike.training.trainer  # noqa: F401 - imported once, before the fork, for every process

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_proc_main, args=(r, listener, out)) for r in range(PROCS)]
    for p in procs:
        p.start()
    listener.close()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(1.0)  # let the failing process write its report
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
