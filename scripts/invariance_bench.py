"""What layout invariance costs, side by side in one run: training steps/s with and without
``training.layout_invariant`` on the same layout, model and batch.

    python scripts/invariance_bench.py                          # fsdp 2 on 2 gloo ranks, debug model, float32
    python scripts/invariance_bench.py --world 1                # one process
    python scripts/invariance_bench.py --dtype bfloat16 --local-batch 4
    python scripts/invariance_bench.py --world 4 --pp 2 --schedule ZBVZeroBubble --local-batch 1   # pp 2 x fsdp 2
    python scripts/invariance_bench.py --world 8 --device cuda --flavor 1B --seq-len 2048   # GPUs (gpu_check.sh)

Each rank builds the model the trainer's way (``build_parallel_model``: meta device, sharded init) twice, once per
setting, and runs ``train_step`` on the same global batch of ``--virtual x --microbatches x --local-batch``
sequences (the canonical decomposition: V virtual ranks of M microbatches of the local batch; the default run cuts
the same batch into the same micro-batches). The settings alternate step by step (A B A B ...) after one untimed
step each, so that a shared machine's load falls on both alike; the slowest rank's median step time is reported,
with the ratio. Printed too: the collectives' bytes per rank and step from the sizes (FSDP's per-micro-batch ring
reduce-scatter against one all-to-all per step; bf16 all-gathers against float32 ones under invariance; not printed
under pipeline parallelism). With ``--pp`` each data-parallel rank runs its share of the batch as one schedule
step of pipeline microbatches of ``--local-batch`` sequences (the canonical microbatch).
On a shared CPU the absolute numbers are noise; the ratio is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(a, invariant: bool):
    from titanlike.config import load_config

    args = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.dtype", a.dtype]
    global_batch = a.virtual * a.microbatches * a.local_batch
    if a.pp > 1:  # one schedule step per rank and step: its share of the batch, in pipeline microbatches
        args += ["--parallelism.pipeline_parallel_degree", str(a.pp), "--parallelism.pipeline_parallel_schedule"]
        args += [a.schedule, "--parallelism.pipeline_parallel_microbatch_size", str(a.local_batch)]
        args += ["--training.local_batch_size", str(global_batch * a.pp // a.world)]
    else:
        args += ["--training.local_batch_size", str(a.local_batch)]
    args += ["--training.global_batch_size", str(global_batch)]
    if invariant:
        args += ["--training.layout_invariant", "true", "--training.virtual_dp_degree", str(a.virtual)]
    return load_config(args, world_size=a.world)


def measure(a, rank: int) -> dict:
    from titanlike.config import model_args_from_config
    from titanlike.models import get_spec
    from titanlike.parallel import ParallelDims, build_parallel_model, loss_group
    from titanlike.training.optim import build_optimizer
    from titanlike.training.step import train_step

    device = torch.device("cuda", rank % torch.cuda.device_count()) if a.device == "cuda" else torch.device("cpu")
    runs = {}
    dims = None
    for name, invariant in (("default", False), ("invariant", True)):
        cfg = _config(a, invariant)
        if a.world == 1:
            dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
        elif dims is None:
            dims = ParallelDims.from_config(cfg, a.world)
            dims.build_mesh(device.type)
        margs = model_args_from_config(cfg, vocab_size=2048)  # the debug model's tokenizer (model.tokenizer test)
        with torch.device("meta"):
            model = get_spec(cfg.model.name).build(margs)
        built = build_parallel_model(model, cfg, dims, device, init_seed=0)
        runs[name] = (cfg, built, build_optimizer(built.model_parts, cfg))
        vocab = margs.vocab_size
    dp = dims.dp if dims.built and dims.dp_enabled else 1
    dp_rank = dims.get_mesh("dp").get_local_rank() if dims.built and dims.dp_enabled else 0
    group = loss_group(dims) if dims.built else None
    per_rank = a.virtual * a.microbatches * a.local_batch // dp
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (per_rank * dp, a.seq_len + 1), generator=g)
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(device)
    size = per_rank if a.pp > 1 else a.local_batch  # a train_step micro-batch: under pp one schedule step
    micro = list(zip(mine[:, :-1].split(size), mine[:, 1:].split(size)))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(a.steps + 1):
        for name, (cfg, built, opt) in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier() if dist.is_initialized() else None
            t0 = time.perf_counter()
            train_step(
                built.model_parts,
                opt,
                micro,
                built.loss,
                max_norm=cfg.training.max_norm,
                clip_fn=built.clip_fn,
                dp_group=group,
                pp_schedule=built.pp_schedule,
                pp_group=built.pp_group,
                has_last_stage=built.has_last_stage,
                forward_ctx=built.forward_context,
                reduction=built.reduction,
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step:
                times[name].append(dt.item())
    params = sum(p.numel() for p in runs["default"][1].model_parts[0].parameters())
    return {name: statistics.median(t) for name, t in times.items()} | {"params": params, "dp": dp}


def _bytes(a, params: int, dp: int) -> dict[str, float]:
    """Per rank and step, from the sizes: FSDP's ring reduce-scatter of every micro-batch (default) against one
    all-to-all of the accumulated gradient (invariant, the same bytes as one ring reduce-scatter); the all-gathers
    (forward and backward per micro-batch, reshard after forward) in bf16 (default, mixed precision) or float32."""
    if dp == 1:
        return {"default": 0.0, "invariant": 0.0}
    leaves = a.virtual * a.microbatches // dp
    shard = params * (dp - 1) / dp
    gather = 2 if a.dtype == "bfloat16" else 4
    return {
        "default": leaves * (shard * 4 + 2 * shard * gather),
        "invariant": shard * 4 + leaves * 2 * shard * 4,
    }


def _rank(rank: int, a, port: int, queue) -> None:
    torch.set_num_threads(a.threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.world), LOCAL_RANK=str(rank)
    )
    if a.world > 1:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank, world_size=a.world)
    try:
        out = measure(a, rank)
        if rank == 0:
            queue.put(out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks: pp x FSDP (1: one process)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline degree (the other ranks FSDP)")
    ap.add_argument("--schedule", default="1F1B", help="pipeline schedule under --pp")
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--virtual", type=int, default=8, help="training.virtual_dp_degree V")
    ap.add_argument("--microbatches", type=int, default=1, help="canonical microbatches per virtual rank M")
    ap.add_argument("--local-batch", type=int, default=2, help="training.local_batch_size (a canonical microbatch)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting (after one untimed)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, a, port, queue)) for r in range(a.world)]
    for p in procs:
        p.start()
    import queue as queues

    deadline = time.monotonic() + a.timeout
    out = None
    while out is None:
        try:
            out = queue.get(timeout=1.0)
        except queues.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                print(f"error: a rank failed (exit codes {failed}) or the run timed out", file=sys.stderr)
                return 1
    for p in procs:
        p.join(timeout=120)
    b = _bytes(a, out["params"], out["dp"]) if a.pp == 1 else {"default": float("nan"), "invariant": float("nan")}
    tokens = a.virtual * a.microbatches * a.local_batch * a.seq_len
    print(
        f"{a.flavor} ({out['params'] / 1e6:.2f}M parameters{' in this stage' if a.pp > 1 else ''}), {a.world} "
        f"rank(s) on {a.device}{f', pp {a.pp} {a.schedule}' if a.pp > 1 else ''}, {a.dtype}, global batch "
        f"V {a.virtual} x M {a.microbatches} x {a.local_batch} sequences of {a.seq_len} ({tokens} tokens)"
    )
    print("| setting | s/step | steps/s | tokens/s | collective MiB per rank and step |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("default", "invariant"):
        s = out[name]
        mib = "-" if b[name] != b[name] else f"{b[name] / 2**20:.2f}"  # not counted under pp (nan)
        print(f"| {name} | {s:.3f} | {1 / s:.2f} | {tokens / s:,.0f} | {mib} |")
    print(f"invariant / default step time: {out['invariant'] / out['default']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({**out, "bytes": b}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
