"""Peak host memory per rank while a model is initialised: the sharded init against the full-model init, side by side.

    python scripts/init_memory.py                         # Llama dim 1024, 8 layers (~0.1B), 1 2 4 8 ranks, FSDP
    python scripts/init_memory.py --dim 2048 --n-layers 16 --ranks 1,8 --layout tp

For each rank count ``n`` it runs two launches of ``n`` CPU processes (gloo), each building the same model for the
layout ``fsdp`` (``data_parallel_shard_degree = n``) or ``tp`` (``tensor_parallel_degree = n``) with the trainer's
own builder (``titanlike.parallel.build_parallel_model``):

* ``sharded`` (the trainer today): the model is built on the meta device, parallelized, and each rank allocates and
  generates only its shards (``titanlike.init``);
* ``full`` (the trainer before): every rank builds and initialises the whole model on the host, then parallelizes.

A rank's number is its peak resident set size (Linux ``VmHWM``) minus its resident size after the imports and the
process group (so the interpreter and torch's own ~0.3 GiB are not counted). Prints the max over ranks, the ratio
sharded / full, and what the rank's shards themselves take.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 2**30


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this script needs Linux)")


def _config_args(a, world: int) -> list[str]:
    deg = "--parallelism.data_parallel_shard_degree" if a.layout == "fsdp" else "--parallelism.tensor_parallel_degree"
    out = [
        "--model.flavor",
        "debugmodel",
        "--model.dim",
        str(a.dim),
        "--model.n_layers",
        str(a.n_layers),
        "--model.n_heads",
        str(a.n_heads),
        "--model.n_kv_heads",
        str(a.n_heads),
        "--training.seq_len",
        "16",
        "--model.max_seq_len",
        "16",
        "--training.local_batch_size",
        "1",
        deg,
        str(world),
    ]
    if a.layout == "tp":
        out += ["--parallelism.data_parallel_shard_degree", "1"]
    return out


def worker(a) -> None:
    """One rank: build the model the ``a.mode`` way; print {"base": ..., "peak": ..., "shards": ...} as JSON."""
    import torch
    import torch.distributed as dist

    from titanlike.config import load_config, model_args_from_config
    from titanlike.models import get_spec
    from titanlike.parallel import ParallelDims, build_parallel_model

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world > 1:
        dist.init_process_group("gloo")
    cfg = load_config(_config_args(a, world), world_size=world)
    args = model_args_from_config(cfg, vocab_size=a.vocab)
    spec = get_spec(cfg.model.name)
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    base = _status("VmRSS")
    cpu = torch.device("cpu")
    if a.mode == "sharded":
        with torch.device("meta"):
            model = spec.build(args)
        built = build_parallel_model(model, cfg, dims, cpu, init_seed=0)
    else:
        model = spec.build(args)
        model.init_weights(seed=0)
        built = build_parallel_model(model, cfg, dims, cpu)
        del model
    peak = _status("VmHWM")
    shards = sum(
        (p.to_local() if hasattr(p, "to_local") else p).nbytes for m in built.model_parts for p in m.parameters()
    )
    print(
        json.dumps(
            {
                "rank": rank,
                "base": base,
                "peak": peak,
                "shards": shards,
                "params": sum(p.numel() for p in spec.build_meta(args).parameters()),
            }
        ),
        flush=True,
    )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, world: int, mode: str) -> list[dict]:
    """``world`` processes of this script in worker mode (torchrun's environment, no torchrun start-up)."""
    port = str(_free_port())
    argv = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--dim",
        str(a.dim),
        "--n-layers",
        str(a.n_layers),
        "--n-heads",
        str(a.n_heads),
        "--vocab",
        str(a.vocab),
        "--layout",
        a.layout,
    ]
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} init on {world} ranks failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--layout", choices=("fsdp", "tp"), default="fsdp")
    ap.add_argument("--worker", choices=("sharded", "full"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.mode = a.worker
        worker(a)
        return 0
    ranks = [int(r) for r in a.ranks.split(",")]
    if a.layout == "tp" and any(a.n_heads % r for r in ranks):
        print(
            f"error: --n-heads {a.n_heads} must be divisible by every --ranks entry under --layout tp", file=sys.stderr
        )
        return 2
    print(
        f"peak host memory per rank during init (VmHWM - RSS before the build, max over ranks), Llama dim {a.dim}, "
        f"{a.n_layers} layers, vocab {a.vocab}, float32, layout {a.layout}"
    )
    print(f"{'ranks':>5} {'sharded GiB':>12} {'full GiB':>9} {'ratio':>6} {'shards GiB':>11}  params")
    for n in ranks:
        sharded, full = launch(a, n, "sharded"), launch(a, n, "full")
        s = max(r["peak"] - r["base"] for r in sharded)
        f = max(r["peak"] - r["base"] for r in full)
        shards = max(r["shards"] for r in sharded)
        print(
            f"{n:>5} {s / GiB:12.3f} {f / GiB:9.3f} {s / f:6.3f} {shards / GiB:11.3f}  "
            f"{sharded[0]['params'] / 1e6:.1f}M",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
