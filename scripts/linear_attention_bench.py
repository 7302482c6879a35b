"""Gated DeltaNet's two forms timed side by side, and what context parallelism sends per layer, in one run.

    python scripts/linear_attention_bench.py                      # CPU, float32, sized for a 2-core machine
    python scripts/linear_attention_bench.py --device cuda        # GPU, bfloat16 (+ flash-linear-attention if there)
    python scripts/linear_attention_bench.py --seq 64 --heads 2 --dk 16 --dv 16 --steps 1 --warmup 0 --cp 2  # smoke

1. **Forms** (``titanlike.models.linear_attention``), one forward + backward per step on the same inputs: the
   chunked gated delta rule (``chunk_gated_delta_rule``, ``--chunk`` tokens a chunk) and the exact recurrent form
   (``recurrent_gated_delta_rule``, token by token), alternating step by step; on CUDA with flash-linear-attention
   installed a third row, its ``chunk_gated_delta_rule`` kernel. Printed: tokens/s and ms per step, the ratio, the
   forms' output difference.
2. **CP bytes per layer and rank** at growing ``seq_len`` (``--seq-lens``), for the model shape of ``--flavor``
   (Qwen3-Next's, batch 1, bf16 activations): a Gated DeltaNet block's state maps + conv halos
   (``titanlike.parallel.state_passing``: independent of the sequence) against a full-attention block's K/V
   all-gather (``titanlike.parallel.context_parallel``: the whole sequence's K and V), from the planner's formulas
   (``titanlike.planner.messages``).
3. **The scan over the cp group**, measured on ``--cp`` gloo processes (CPU): the bytes one rank really sends per
   Gated DeltaNet layer (counted on ``gather_pieces``), equal to the formula, and the time of the all-gather scan
   (what titanlike runs: one collective, then ``2 cp`` small matmuls on every rank) against a sequential scan (each
   rank waits for the state of the chunk before its piece: up the ranks and back down under the load-balanced
   split, ``2 (cp - 1)`` dependent point-to-point hops; its backward would be the same chain reversed).

``--json PATH`` writes the same as JSON. CPU timings on a shared machine are noise; a GPU number comes from a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from titanlike.models.linear_attention import (  # noqa: E402
    chunk_gated_delta_rule,
    fla_kernel,
    l2norm,
    recurrent_gated_delta_rule,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 512 CPU, 8192 CUDA)")
    ap.add_argument("--heads", type=int, default=None, help="value heads (= key heads here; default 4 CPU, 32 CUDA)")
    ap.add_argument("--dk", type=int, default=None, help="key head dim (default 64 CPU, 128 CUDA)")
    ap.add_argument("--dv", type=int, default=None, help="value head dim (default 64 CPU, 128 CUDA)")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable on a shared machine)")
    ap.add_argument("--flavor", default="80B-A3B", help="the qwen3_next flavor whose per-layer cp bytes are printed")
    ap.add_argument("--seq-lens", default="4096,32768,262144", help="comma-separated seq_lens of the cp bytes table")
    ap.add_argument("--cp", type=int, default=2, help="gloo processes of the scan measurement (0: skip it)")
    ap.add_argument("--scan-reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = a.device == "cuda"
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    for key, cpu, cuda in (("seq", 512, 8192), ("heads", 4, 32), ("dk", 64, 128), ("dv", 64, 128)):
        if getattr(a, key) is None:
            setattr(a, key, cuda if gpu else cpu)
    problems = [
        f"--{k} {getattr(a, k)} must be >= 1"
        for k in ("batch", "seq", "heads", "dk", "dv", "chunk")
        if getattr(a, k) < 1
    ]
    if a.cp == 1 or a.cp < 0:
        problems.append(f"--cp {a.cp}: give 0 (skip the scan measurement) or >= 2 processes")
    if gpu and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device")
    if problems:
        ap.error("; ".join(problems))
    return a


def _inputs(a):
    g = torch.Generator().manual_seed(0)
    dtype, dev = DTYPES[a.dtype], a.device
    shape = (a.batch, a.seq, a.heads)
    q = l2norm(torch.randn(*shape, a.dk, generator=g)).to(dev, dtype).requires_grad_()
    k = l2norm(torch.randn(*shape, a.dk, generator=g)).to(dev, dtype).requires_grad_()
    v = torch.randn(*shape, a.dv, generator=g).to(dev, dtype).requires_grad_()
    decay = (-0.1 * torch.rand(*shape, generator=g)).to(dev).requires_grad_()
    beta = torch.rand(*shape, generator=g).to(dev, dtype).requires_grad_()
    return q, k, v, decay, beta


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_forms(a) -> dict:
    """ms per forward + backward of each form, alternating step by step; their output difference."""
    inputs = _inputs(a)
    forms = {
        "chunked": lambda *x: chunk_gated_delta_rule(*x, chunk_size=a.chunk)[0],
        "recurrent": lambda *x: recurrent_gated_delta_rule(*x)[0],
    }
    kernel = fla_kernel() if a.device == "cuda" else None
    if kernel is not None:
        forms["fla"] = lambda q, k, v, g, b: kernel(q, k, v, g=g, beta=b, scale=q.shape[-1] ** -0.5)[0]
    times = {n: [] for n in forms}
    outs = {}
    for step in range(a.warmup + a.steps):
        for name, fn in forms.items():
            _sync(a.device)
            t0 = time.perf_counter()
            out = fn(*inputs)
            out.float().square().sum().backward()
            _sync(a.device)
            if step >= a.warmup:
                times[name].append(time.perf_counter() - t0)
            outs[name] = out.detach().float()
    tokens = a.batch * a.seq
    rows = {n: {"ms": 1e3 * sum(t) / len(t), "tokens_per_s": tokens * len(t) / sum(t)} for n, t in times.items()}
    diff = {n: (outs[n] - outs["recurrent"]).abs().max().item() for n in outs if n != "recurrent"}
    return {"rows": rows, "max_output_diff_vs_recurrent": diff}


def cp_bytes_table(a) -> list[dict]:
    """Bytes one cp rank moves per layer and microbatch forward (batch 1, bf16 activations), from the planner."""
    from titanlike.config import model_args_from_config, parse_config
    from titanlike.planner import messages
    from titanlike.planner.layout import Layout

    rows = []
    for seq in (int(s) for s in a.seq_lens.split(",") if s):
        argv = ["--model.name", "qwen3_next", "--model.flavor", a.flavor, "--model.max_seq_len", str(seq)]
        argv += ["--training.seq_len", str(seq), "--training.local_batch_size", "1", "--training.dtype", "bfloat16"]
        argv += ["--parallelism.context_parallel_degree", "2", "--model.n_layers", "4"]
        cfg = parse_config(argv)
        args = model_args_from_config(cfg).replace(vocab_size=151936)
        lo = Layout.from_config(cfg, 2, args, 8)
        fwd = {m.what: m.nbytes for m in messages(lo, args) if m.dim == "cp" and m.phase == "forward"}
        linear = (
            fwd["linear-attention state maps of every linear block"] + fwd["short-conv halos of every linear block"]
        )
        rows.append({"seq_len": seq, "deltanet_bytes": linear, "attention_bytes": 2 * fwd["K and V of every block"]})
    return rows


# ---------------------------------------------------------------------------------------------- the scan, on gloo
def _scan_worker(rank: int, world: int, port: int, a, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import titanlike.parallel.state_passing as sp

    mesh = init_device_mesh("cpu", (world,))
    core = sp.ContextParallelGatedDelta(mesh, a.chunk)
    sent = []
    gather = sp.gather_pieces

    def counting(x, m):
        sent.append(x.numel() * x.element_size())
        return gather(x, m)

    sp.gather_pieces = counting
    g = torch.Generator().manual_seed(rank)
    s = 2 * a.chunk
    q, k = (l2norm(torch.randn(1, s, a.heads, a.dk, generator=g)) for _ in range(2))
    v = torch.randn(1, s, a.heads, a.dv, generator=g)
    core(q, k, v, -0.1 * torch.rand(1, s, a.heads, generator=g), torch.rand(1, s, a.heads, generator=g))
    sp.gather_pieces = gather
    maps = torch.randn(2, 1, a.heads, a.dk, a.dv + a.dk, generator=g)
    order = [(r, 2 * world - 1 - r) for r in range(world)]

    def all_gather_scan():
        sp.entering_states(sp.true_order(sp.gather_pieces(maps, mesh), order), a.dv, 2 * world - 1)

    def sequential_scan():  # the state travels in true order: up the ranks (chunks 0..cp-1), back down (cp..2cp-1)
        state = torch.zeros(1, a.heads, a.dk, a.dv)
        if rank > 0:
            dist.recv(state, rank - 1)
        state = (maps[0, ..., a.dv :] @ state + maps[0, ..., : a.dv]).contiguous()
        if rank < world - 1:
            dist.send(state, rank + 1)
            dist.recv(state, rank + 1)
        state = (maps[1, ..., a.dv :] @ state + maps[1, ..., : a.dv]).contiguous()
        if rank > 0:
            dist.send(state, rank - 1)

    times = {}
    for name, fn in (("all_gather", all_gather_scan), ("sequential", sequential_scan)):
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.scan_reps):
            fn()
        dist.barrier()
        times[name] = 1e3 * (time.perf_counter() - t0) / a.scan_reps
    if rank == 0:
        want = sp.state_message_numel(1, a.heads, a.dk, a.dv) * 4
        Path(out_path).write_text(json.dumps({"sent_bytes": sent[0], "formula_bytes": want, "ms": times}))
    dist.destroy_process_group()


def measure_scan(a) -> dict:
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "scan.json")
        mp.start_processes(_scan_worker, args=(a.cp, port, a, out), nprocs=a.cp, start_method="fork")
        return json.loads(Path(out).read_text())


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main(argv=None) -> dict:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    shape = f"batch {a.batch} x seq {a.seq}, {a.heads} heads, dk {a.dk}, dv {a.dv}, chunk {a.chunk}"
    print(f"Gated DeltaNet forms, {shape}, {a.dtype} on {a.device}, forward + backward")
    forms = time_forms(a)
    for name, r in forms["rows"].items():
        print(f"{name:10s} {r['tokens_per_s']:>12,.0f} tokens/s  {r['ms']:9.2f} ms/step")
    ratio = forms["rows"]["recurrent"]["ms"] / forms["rows"]["chunked"]["ms"]
    print(
        f"ratio recurrent/chunked (ms): {ratio:.2f}; max |chunked - recurrent| {forms['max_output_diff_vs_recurrent']}"
    )
    print(f"\ncp bytes per layer and rank, one forward ({a.flavor}, batch 1, bf16, cp 2):")
    print(f"{'seq_len':>10s}  {'Gated DeltaNet':>15s}  {'full attention':>15s}")
    table = cp_bytes_table(a)
    for r in table:
        print(f"{r['seq_len']:>10,d}  {_mib(r['deltanet_bytes']):>15s}  {_mib(r['attention_bytes']):>15s}")
    result = {"args": vars(a), "forms": forms, "ratio_recurrent_over_chunked": ratio, "cp_bytes": table}
    if a.cp:
        scan = measure_scan(a)
        print(
            f"\nscan over {a.cp} gloo ranks: one rank sends {_mib(scan['sent_bytes'])} per Gated DeltaNet layer "
            f"(formula {_mib(scan['formula_bytes'])}); all-gather scan {scan['ms']['all_gather']:.3f} ms, "
            f"sequential {scan['ms']['sequential']:.3f} ms"
        )
        result["scan"] = scan
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
