"""Peak memory per rank of the memory modes, side by side: FSDP (ZeRO-3), replicated data parallel, ZeRO-1, FSDP with
CPU offload and FSDP with activation offload, on the debug model at dp 2 (two gloo processes on this machine).

    python scripts/memory_modes.py                      # configs/debug_model.toml, seq 256, local batch 4, 2 steps
    python scripts/memory_modes.py --seq-len 512 --steps 3
    python scripts/memory_modes.py --one-device cuda --config configs/llama3_1b.toml --seq-len 2048 --dtype bfloat16
                                                        # one GPU: no offload vs activation offload vs full AC

Each mode builds the model the trainer's way (``build_parallel_model`` on the meta device, the sharded init, the
trainer's AdamW) and runs real ``train_step`` calls under ``torch.distributed._tools.mem_tracker.MemTracker``,
which records every tensor storage alive at the peak by kind (parameters, gradients, optimizer state, activations,
temporaries) and device. Rank 0 prints one row per mode and rank (MiB), plus the planner's figures for the same
layout. On a CPU-only machine the "device" is the CPU: CPU offload moves nothing (its rows equal FSDP's: the host is
the device) and activation offload copies what the blocks save into other CPU tensors; the rows show where each
mode puts its bytes, and the planner's columns what they would be on an accelerator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 2**20
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
FSDP = ["--parallelism.data_parallel_shard_degree", "2"]
MODES = {
    "fsdp2": FSDP,
    "ddp2": DDP,
    "zero1 (ddp2)": [*DDP, "--parallelism.distributed_optimizer", "true"],
    "fsdp2 + cpu offload": [*FSDP, "--training.enable_cpu_offload", "true"],
    "fsdp2 + act offload": [*FSDP, "--activation_checkpoint.offload", "true"],
}
# one process (--one-device): the activation modes on the device itself (a GPU: what the offload frees there)
ONE = {
    "one device": [],
    "act offload": ["--activation_checkpoint.offload", "true"],
    "full AC": ["--activation_checkpoint.mode", "full"],
    "act offload + AC every 2": [
        "--activation_checkpoint.offload",
        "true",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
}
KINDS = ("Parameter", "Gradient", "Optstate", "Activation", "Temp")


def _config(mode: str, a, world: int = 2):
    from titanlike.config import load_config

    base = ["--job.config_file", a.config, "--training.seq_len", str(a.seq_len), "--training.dtype", a.dtype]
    extra = MODES[mode] if world > 1 else ONE[mode]
    return load_config([*base, "--training.local_batch_size", str(a.local_batch), *extra], world_size=world)


def _measure(mode: str, a, rank: int, world: int = 2, device: str = "cpu") -> dict[str, float]:
    """Peak MiB by kind (MemTracker, on the CPU) or in total (the CUDA allocator's peak) over ``a.steps`` steps."""
    import torch

    from titanlike.config import model_args_from_config
    from titanlike.models import get_spec
    from titanlike.parallel import ParallelDims, build_parallel_model
    from titanlike.training.optim import build_optimizer
    from titanlike.training.step import train_step

    cfg = _config(mode, a, world)
    args = model_args_from_config(cfg, vocab_size=a.vocab)
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    with torch.device("meta"):
        model = get_spec(cfg.model.name).build(args)
    built = build_parallel_model(model, cfg, dims, torch.device(device), init_seed=0)
    optimizer = build_optimizer(built.model_parts, cfg)
    g = torch.Generator().manual_seed(rank)
    tracker = None
    if device == "cpu":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(*built.model_parts, optimizer)
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with tracker or contextlib.nullcontext():
        for _ in range(a.steps):
            tokens = torch.randint(0, args.vocab_size, (a.local_batch, cfg.training.seq_len + 1), generator=g)
            tokens = tokens.to(device)
            train_step(
                built.model_parts,
                optimizer,
                [(tokens[:, :-1], tokens[:, 1:])],
                built.loss,
                max_norm=cfg.training.max_norm,
                clip_fn=built.clip_fn,
                dp_group=dims.get_mesh("dp").get_group() if world > 1 else None,
                forward_ctx=built.forward_context,
            )
            if tracker is not None:
                tracker.reset_mod_stats()  # (the per-module stats of one step; the peak is kept)
    if tracker is None:
        total = torch.cuda.max_memory_allocated() - base
        return {**dict.fromkeys(KINDS, float("nan")), "Total": total / MiB}
    peak = {getattr(k, "value", str(k)): v for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items()}
    return {k: peak.get(k, 0) / MiB for k in (*KINDS, "Total")}


def _planned(mode: str, a, world: int = 2) -> tuple[float, float]:
    """The planner's (device, host) bytes of rank 0 in MiB for the same layout."""
    from titanlike.config import model_args_from_config
    from titanlike.planner.layout import Layout
    from titanlike.planner.memory import rank_host_memory, rank_memory

    cfg = _config(mode, a, world)
    args = model_args_from_config(cfg, vocab_size=a.vocab)
    lo = Layout.from_config(cfg, world, args, gpus_per_node=world)
    return sum(it.bytes for it in rank_memory(lo, args)) / MiB, sum(it.bytes for it in rank_host_memory(lo, args)) / MiB


def _rank_main(rank: int, port: int, a) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for mode in MODES:
        measured = _measure(mode, a, rank)
        every = [None, None]
        dist.all_gather_object(every, measured)
        rows.append((mode, every))
    if rank == 0:
        _report(rows, a, 2)
    dist.destroy_process_group()


def _report(rows, a, world: int) -> None:
    head = f"{'mode':26s} {'rank':>4s} " + " ".join(f"{k[:8]:>9s}" for k in (*KINDS, "Total"))
    print(head + f" {'plan dev':>9s} {'plan host':>9s}   (MiB)")
    out = []
    for mode, every in rows:
        dev, host = _planned(mode, a, world)
        for r, m in enumerate(every):
            cells = " ".join(f"{m[k]:9.2f}" for k in (*KINDS, "Total"))
            print(f"{mode:26s} {r:4d} {cells} {dev:9.2f} {host:9.2f}", flush=True)
            out.append({"mode": mode, "rank": r, **m, "plan_device": dev, "plan_host": host})
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"world": world, "device": a.one_device or "cpu", "rows": out}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/debug_model.toml")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--local-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048, help="vocabulary size (the debug model's tokenizer: 2048)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="training.dtype")
    ap.add_argument("--one-device", default="", help="cpu | cuda: the activation modes in this one process instead")
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.one_device:
        _report([(mode, [_measure(mode, a, 0, 1, a.one_device)]) for mode in ONE], a, 1)
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, a), nprocs=2, start_method="fork")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
