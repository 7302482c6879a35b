"""The expert-parallel dispatch, uneven against padded, side by side in one run: time, peak memory, bytes moved.

    python scripts/ep_dispatch_bench.py                 # 2 gloo ranks on CPU, ep 2, float32, one MoE layer
    python scripts/ep_dispatch_bench.py --ep 1          # one process: the padded buffers without the all-to-alls
    python scripts/ep_dispatch_bench.py --tokens 64 --dim 16 --hidden 32 --experts 4 --steps 1 --warmup 0  # smoke

Every rank builds the same ``titanlike.models.moe.MoE`` layer twice (same weights), sets one copy's expert dispatch
to ``"uneven"`` and the other's to ``"padded"`` (``parallelism.expert_dispatch``), puts expert parallelism over the
``--ep`` ranks on both, and runs forward + backward on its own ``--tokens`` tokens, the two copies alternating step by
step (``--steps`` timed of each after ``--warmup`` untimed) so drifting load on a shared machine hits both alike.
Printed per dispatch (rank 0's numbers): ms per step, the forward + backward peak of the tensors allocated
(``torch.distributed._tools.mem_tracker.MemTracker``, the layer's weights and the input included), the bytes this
rank sent in all-to-alls per step and the expert rows computed; then the ratios padded / uneven and the outputs'
largest difference (they compute the same thing). ``--json PATH`` writes the same as JSON. Timings on a shared CPU
are noise next to a GPU's; the bytes and the memory are what the padding costs anywhere.
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
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from titanlike.models.moe import MoE, MoEArgs, padded_capacity, set_expert_dispatch  # noqa: E402
from titanlike.parallel.expert_parallel import apply_ep  # noqa: E402

DISPATCHES = ("uneven", "padded")
MiB = 2**20


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=2, help="ranks (gloo processes); 1: one process, no all-to-all")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of one routed expert")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    problems = [f"--{n} must be >= 1" for n in ("ep", "tokens", "dim", "hidden", "experts", "top_k", "steps")
                if getattr(a, n) < 1]  # fmt: skip
    if a.experts % a.ep:
        problems.append(f"--ep {a.ep} does not divide --experts {a.experts}")
    if a.top_k > a.experts:
        problems.append(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    if problems:
        ap.error("; ".join(problems))
    return a


class _SentBytes(TorchDispatchMode):
    """Bytes handed to all-to-alls (what this rank sends)."""

    def __init__(self):
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all" in func.__name__:
            self.sent += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _layers(a: argparse.Namespace, mesh) -> dict[str, MoE]:
    torch.manual_seed(0)
    args = MoEArgs(dim=a.dim, hidden_dim=a.hidden, num_experts=a.experts, top_k=a.top_k, experts_impl="loop")
    layers = {d: MoE(args) for d in DISPATCHES}
    with torch.no_grad():
        for p in layers["uneven"].parameters():
            torch.nn.init.trunc_normal_(p, std=0.02)
    layers["padded"].load_state_dict(layers["uneven"].state_dict())
    for d, layer in layers.items():
        set_expert_dispatch(layer, d)
        if mesh is not None:
            apply_ep(layer, mesh)
    return layers


def _step(layer: MoE, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = layer(x.detach().requires_grad_())
    out.square().mean().backward()
    return time.perf_counter() - t0, out.detach()


def _peak_and_bytes(layer: MoE, x: torch.Tensor) -> tuple[int, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    layer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(layer, x)
    with tracker, _SentBytes() as sent:
        layer(x.detach().requires_grad_()).square().mean().backward()
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"], sent.sent


def run(rank: int, a: argparse.Namespace, out: dict) -> dict:
    mesh = init_device_mesh("cpu", (a.ep,), mesh_dim_names=("ep",)) if a.ep > 1 else None
    torch.set_num_threads(1)
    layers = _layers(a, mesh)
    x = torch.randn(1, a.tokens, a.dim, generator=torch.Generator().manual_seed(rank))
    times, outs = dict.fromkeys(DISPATCHES, 0.0), {}
    for i in range(a.warmup + a.steps):
        for d, layer in layers.items():
            t, outs[d] = _step(layer, x)
            times[d] += t if i >= a.warmup else 0.0
    capacity = padded_capacity(a.tokens, layers["padded"].experts, x.dtype)
    rows = {"uneven": a.tokens * a.top_k, "padded": a.experts * capacity}
    for d, layer in layers.items():
        peak, sent = _peak_and_bytes(layer, x)
        out[d] = {"ms_per_step": 1000 * times[d] / a.steps, "peak_mib": peak / MiB, "a2a_mib_sent": sent / MiB,
                  "expert_rows": rows[d]}  # fmt: skip
    out["max_output_diff"] = (outs["padded"] - outs["uneven"]).abs().max().item()
    out["capacity"] = capacity
    return out


def _rank_main(rank: int, a: argparse.Namespace, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank), WORLD_SIZE=str(a.ep))
    dist.init_process_group("gloo", rank=rank, world_size=a.ep)
    try:
        out = run(rank, a, {})
        if rank == 0:
            Path(path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    a = parse(argv)
    if a.ep == 1:
        result = run(0, a, {})
    else:
        path = Path(a.json or f"/tmp/ep_dispatch_bench_{os.getpid()}.json")
        mp.start_processes(_rank_main, args=(a, str(path)), nprocs=a.ep, start_method="fork")
        result = json.loads(path.read_text())
    result["args"] = {k: v for k, v in vars(a).items() if k != "json"}
    print(
        f"MoE layer under ep {a.ep}: {a.tokens} tokens per rank x dim {a.dim}, {a.experts} experts of hidden "
        f"{a.hidden}, top-{a.top_k}, float32, CPU; forward + backward, {a.steps} steps each after {a.warmup} warmup; "
        f"padded capacity {result['capacity']} rows per (rank, expert)"
    )
    for d in DISPATCHES:
        r = result[d]
        print(
            f"{d:<7} {r['ms_per_step']:>9.1f} ms/step  peak {r['peak_mib']:>8.1f} MiB  all-to-all sent "
            f"{r['a2a_mib_sent']:>7.2f} MiB/step  expert rows {r['expert_rows']}"
        )
    p, u = result["padded"], result["uneven"]
    moved = f", bytes {p['a2a_mib_sent'] / u['a2a_mib_sent']:.2f}x" if u["a2a_mib_sent"] else ""
    print(
        f"padded / uneven: time {p['ms_per_step'] / u['ms_per_step']:.2f}x, peak {p['peak_mib'] / u['peak_mib']:.2f}x"
        f"{moved}; max |padded - uneven| output {result['max_output_diff']:.1e}"
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
