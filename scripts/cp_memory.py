"""Activation memory per rank under context parallelism, measured on CPU ranks (gloo), side by side for cp 1, 2, 4.

    python scripts/cp_memory.py                       # debug model, 1 x 8192 tokens, cp 1 2 4
    python scripts/cp_memory.py --seq-len 16384 --cps 1,2,4,8
    python scripts/cp_memory.py --methods allgather,alltoall,ring,hybrid   # each cp method; + the bytes sent per layer

For each cp degree, ``cp`` processes each build the same debug model (float32), apply ``apply_cp`` (cp > 1), run
the forward and the loss on their ``seq_len / cp`` tokens of one sequence, and count the bytes autograd holds for
the backward at the end of the forward (every distinct storage that a ``saved_tensors_hooks`` pack saw: that is
the activation memory, which peaks there). The bytes are split by where they were saved:

* ``outside attention``: embeddings, norms, projections, RoPE, SwiGLU, the head and the loss (per token: 1/cp);
* ``attention core``: what the attention kernel keeps. Under CP that includes the all-gathered K and V of the
  whole sequence (kv heads only: they do not shrink with cp) and, on CPU, the boolean causal mask of each query
  chunk over its keys (CUDA uses a mask-free ``CausalBias``, so that part is a CPU artefact).

With ``--methods`` (parallelism.context_parallel_method) one row per method and cp, and a column of the bytes a rank
sent per layer for the cp collectives over the forward and the backward (counted as they dispatch: an all-gather
sends ``(cp - 1)`` x its input, a reduce-scatter or an all-to-all ``(cp - 1) / cp`` of it, a point-to-point send
its tensor; max over ranks). ``hybrid`` runs with all-to-all groups of 2 cp ranks (rows from cp 4).

Prints one row per cp and the ratio to cp 1. Parameters and optimizer states are not activations (FSDP shards
them over dp_shard x cp anyway); the peak of transient buffers inside one op is not counted.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 2**20


HYBRID_A2A = 2  # the method "hybrid": all-to-all groups of 2 cp ranks (its rows from cp 4 on)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sent_counter():
    """A dispatch mode adding up the bytes this rank sends in the cp collectives (module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sent(TorchDispatchMode):
        def __init__(self, cp: int):
            super().__init__()
            self.cp, self.bytes = cp, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send"):
                t = args[0][0] if name == "send" else args[0]
                n = t.numel() * t.element_size()
                g = self.cp
                if name == "all_to_all_single":  # hybrid's all-to-alls span its groups, not the whole cp group
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    g = _resolve_process_group(args[-1]).size()
                self.bytes += {
                    "all_gather_into_tensor": n * (g - 1),
                    "send": n,
                }.get(name, n * (g - 1) // g)
            return func(*args, **(kwargs or {}))

    del torch
    return Sent


def measure(flavor: str, seq_len: int, vocab: int, cp: int, rank: int, method: str = "allgather") -> dict[str, int]:
    """This rank's saved-for-backward bytes at the end of the forward: {"outside": ..., "core": ...}, and the bytes
    it sent for cp per layer ("sent")."""
    import torch

    from titanlike.loss import cross_entropy_loss
    from titanlike.models.decoder import AttentionCore
    from titanlike.models.llama import FLAVORS, Transformer

    args = FLAVORS[flavor].replace(vocab_size=vocab, max_seq_len=max(seq_len, FLAVORS[flavor].max_seq_len))
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    core_types: tuple[type, ...] = (AttentionCore,)
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from titanlike.parallel.context_parallel import (
            ContextParallelAttention,
            HybridAttention,
            UlyssesAttention,
            apply_cp,
            cp_shard,
        )
        from titanlike.parallel.ring_attention import RingAttention

        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        apply_cp(model, mesh, method=method, a2a_degree=HYBRID_A2A if method == "hybrid" else 1)
        x, y = cp_shard(x, cp, rank), cp_shard(y, cp, rank)
        core_types = (ContextParallelAttention, UlyssesAttention, RingAttention, HybridAttention)
    inside = [0]
    for m in model.modules():
        if isinstance(m, core_types):
            m.register_forward_pre_hook(lambda *a: inside.__setitem__(0, inside[0] + 1))
            m.register_forward_hook(lambda *a: inside.__setitem__(0, inside[0] - 1))
    seen: dict[tuple, str] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.data_ptr() not in params and key not in seen:
            seen[key] = "core" if inside[0] else "outside"
        return t

    sent = _sent_counter()(cp)
    with sent, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_loss(model(x), y, reduction="sum")
    out = {"outside": 0, "core": 0}
    for (_, nbytes), where in seen.items():
        out[where] += nbytes
    with sent:
        loss.backward()  # the backward runs (collectives match on every rank), and frees what was counted
    out["sent"] = sent.bytes // args.n_layers
    return out


def _rank(rank: int, world: int, port: int, flavor: str, seq_len: int, vocab: int, queue, method: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, measure(flavor, seq_len, vocab, world, rank, method)))
    finally:
        if world > 1:
            dist.destroy_process_group()


def run(cp: int, flavor: str, seq_len: int, vocab: int, method: str = "allgather") -> list[dict[str, int]]:
    """Every rank's numbers for one cp degree (cp processes)."""
    import torch.multiprocessing as mp

    if cp == 1:  # no process group: in this process
        return [measure(flavor, seq_len, vocab, 1, 0)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, flavor, seq_len, vocab, queue, method)) for r in range(cp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"cp {cp}: a rank exited with {p.exitcode}")
    return [results[r] for r in range(cp)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument(
        "--methods",
        default="",
        help="comma-separated cp methods, one row each (allgather,alltoall,ring,hybrid: a2a 2, from cp 4)",
    )
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    cps = [int(c) for c in a.cps.split(",")]
    for cp in cps:
        if a.seq_len % (2 * cp):
            print(f"error: --seq-len {a.seq_len} is not divisible by 2 x cp = {2 * cp}", file=sys.stderr)
            return 2
    print(
        f"activation memory per rank (saved for backward at the end of the forward), {a.flavor}, 1 x {a.seq_len} "
        f"tokens, float32, vocab {a.vocab}, CPU / gloo; max over ranks"
    )
    print(
        f"{'cp':>3} {'method':<10}" * bool(methods) + f"{'' if methods else 'cp':>3} {'outside attn MiB':>17} "
        f"{'ratio':>6} {'attn core MiB':>14} {'ratio':>6} {'total MiB':>10} {'ratio':>6}"
        + f" {'sent/layer MiB':>15}"
        * bool(methods)
    )
    base = None
    for cp in cps:
        for method in ([m for m in methods if m != "hybrid" or cp > HYBRID_A2A] if cp > 1 else methods[:1]) or [None]:
            ranks = run(cp, a.flavor, a.seq_len, a.vocab, method or "allgather")
            row = {k: max(r[k] for r in ranks) for k in ("outside", "core", "sent")}
            row["total"] = max(r["outside"] + r["core"] for r in ranks)
            base = base or row
            head = f"{cp:>3} {method:<10}    " if method else f"{cp:>3}"
            print(
                f"{head} {row['outside'] / MiB:17.1f} {row['outside'] / base['outside']:6.3f} "
                f"{row['core'] / MiB:14.1f} {row['core'] / base['core']:6.3f} {row['total'] / MiB:10.1f} "
                f"{row['total'] / base['total']:6.3f}" + f" {row['sent'] / MiB:15.2f}" * bool(method),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
