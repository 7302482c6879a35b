"""Optimizer step time, side by side in one run: distributed Muon vs naive Muon on every rank vs AdamW.

    python scripts/muon_bench.py                                   # 4 gloo ranks, fsdp 4, dim 256 x 4 blocks
    python scripts/muon_bench.py --world 4 --tp 2 --dim 512        # tp 2 x fsdp 2
    python scripts/muon_bench.py --world 1 --device cuda --flavor 1B --ns-dtype bfloat16   # one GPU (gpu_check.sh)

The model is built the trainer's way (``build_parallel_model``: meta device, sharded init) on ``--world`` ranks
(``--tp`` x FSDP over the rest); every parameter gets a gradient (a copy of its weight, so the matrices are full
rank), and ``optimizer.step()`` alone is timed, the slowest rank's, median over ``--steps`` after one untimed step
(which builds the state and, for Muon, the owners and buckets). Rows:

* ``adamw``: ``build_optimizer`` with ``optimizer.name = AdamW`` (foreach on CPU, fused on CUDA);
* ``muon``: ``optimizer.name = Muon``: every matrix gathered to its owner rank (round-robin over the ranks),
  orthogonalized there once, scattered back (two all-to-alls per bucket);
* ``naive_muon`` (with more than one rank): the same optimizer, but every rank all-gathers every matrix
  (``full_tensor``) and runs Newton-Schulz on all of them: the work of one device, repeated on each rank.

Printed: seconds per step, each row's ratio to AdamW, muon / naive_muon (with W ranks and Newton-Schulz dominating
it tends to 1/W: the division of work; the all-to-alls and the elementwise parts do not divide), the matrices and
Newton-Schulz FLOPs each rank ran. On a shared CPU the absolute times are noise; the ratio is the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
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


@contextlib.contextmanager
def naive_orthogonalization():
    """Every rank gathers every matrix of a bucket whole and orthogonalizes all of them (then keeps its block)."""
    from torch.distributed.tensor import DTensor

    import titanlike.parallel.muon as muon

    def every_rank(gr, bucket, updates, opt):
        out = []
        for k in bucket.items:
            m = gr.matrices[k]
            p = m.param
            full = DTensor.from_local(
                updates[p], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            ).full_tensor()
            box = muon._narrow(full, [(lo, hi - lo) for lo, hi in m.box])
            result = opt._ns(box.reshape(m.rows, m.cols), m).reshape(box.shape)
            out.append((m, muon._take(result, m.mine)))
        return out

    original = muon._orthogonalize_bucket
    muon._orthogonalize_bucket = every_rank
    try:
        yield
    finally:
        muon._orthogonalize_bucket = original


def _config(a, name: str):
    from titanlike.config import load_config

    return load_config(
        [
            "--model.flavor",
            a.flavor,
            *(["--model.dim", str(a.dim)] if a.dim else []),
            *(["--model.n_layers", str(a.layers)] if a.layers else []),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "1",
            "--parallelism.tensor_parallel_degree",
            str(a.tp),
            "--optimizer.name",
            name,
            *(["--optimizer.ns_dtype", a.ns_dtype] if name == "Muon" else []),
            "--training.device",
            a.device,
        ],
        world_size=a.world,
    )


def measure(a, rank: int) -> dict:
    from titanlike.config import model_args_from_config
    from titanlike.models import get_spec
    from titanlike.parallel import ParallelDims, build_parallel_model
    from titanlike.training.optim import build_optimizer

    device = (
        torch.device("cuda", rank % max(1, torch.cuda.device_count())) if a.device == "cuda" else torch.device("cpu")
    )
    results = {}
    dims = None
    rows = (("adamw", "AdamW"), ("muon", "Muon"), ("naive_muon", "Muon"))
    for row, name in rows if a.world > 1 else rows[:2]:  # one rank: nothing to divide, naive is Muon
        cfg = _config(a, name)
        if dims is None:
            dims = ParallelDims.from_config(cfg, a.world)
            dims.build_mesh(device.type)
        args = model_args_from_config(cfg, vocab_size=2048)
        model = get_spec(cfg.model.name).build_meta(args)
        parts = build_parallel_model(model, cfg, dims, device, init_seed=0).model_parts
        for part in parts:
            for p in part.parameters():
                p.grad = p.detach().clone().mul_(1e-2)
        opt = build_optimizer(parts, cfg)
        times = []
        with naive_orthogonalization() if row == "naive_muon" else contextlib.nullcontext():
            for i in range(a.steps + 1):
                if a.world > 1:
                    dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
                if a.world > 1:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
                if i:
                    times.append(elapsed.item())
        stats = getattr(opt, "stats", None)
        counts = [None] * a.world
        mine = None if stats is None else {"matrices": stats.matrices, "ns_flops": stats.ns_flops}
        if a.world > 1:
            dist.all_gather_object(counts, mine)
        else:
            counts = [mine]
        results[row] = {"seconds": statistics.median(times), "ranks": counts}
        del opt, parts, model
    return results


def _rank(rank: int, a, port: int, queue) -> None:
    torch.set_num_threads(a.threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.world), LOCAL_RANK=str(rank)
    )
    backend = "nccl" if a.device == "cuda" else "gloo"
    if a.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=a.world)
    try:
        out = measure(a, rank)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def run(a) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, a, port, queue)) for r in range(a.world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=a.timeout)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="ranks (gloo processes on CPU, one per GPU on CUDA)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP over the other ranks)")
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--dim", type=int, default=256, help="model.dim (0: the flavor's)")
    ap.add_argument("--layers", type=int, default=4, help="model.n_layers (0: the flavor's)")
    ap.add_argument("--ns-dtype", default="float32", choices=("bfloat16", "float32", "float64"))
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if a.world < 1 or a.world % a.tp:
        print(f"error: --world {a.world} must be a positive multiple of --tp {a.tp}", file=sys.stderr)
        return 2
    result = run(a)
    adamw = result["adamw"]["seconds"]
    print(
        f"optimizer step, {a.world} rank(s), tp {a.tp} x fsdp {a.world // a.tp}, {a.flavor} dim {a.dim or 'default'} "
        f"x {a.layers or 'default'} blocks, Newton-Schulz in {a.ns_dtype} ({a.device}):"
    )
    print(f"  {'row':<11}{'s/step':>10}{'x adamw':>9}   matrices per rank   Newton-Schulz GFLOP per rank")
    for row, r in result.items():
        ranks = [c for c in r["ranks"] if c is not None]
        mats = "-" if not ranks else ",".join(str(c["matrices"]) for c in ranks)
        flops = "-" if not ranks else ",".join(f"{c['ns_flops'] / 1e9:.2f}" for c in ranks)
        print(f"  {row:<11}{r['seconds']:>10.4f}{r['seconds'] / adamw:>9.2f}   {mats:<19}{flops}")
    ratio = result["muon"]["seconds"] / result["naive_muon"]["seconds"] if "naive_muon" in result else None
    if ratio is not None:
        print(
            f"  muon / naive_muon = {ratio:.3f} (1/{a.world} = {1 / a.world:.3f}: Newton-Schulz divided over the ranks)"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": result, "muon_over_naive": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
