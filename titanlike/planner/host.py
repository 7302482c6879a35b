"""Does this node's share of a CPU run fit the host's memory? Checked by the trainer before any process group.

The model is never materialised whole (it is built on the meta device and each rank allocates only its shards), so
the host must hold, for every rank on this node, what the planner's memory model says that rank keeps whatever the
batch: its parameter shards, their gradients and AdamW states, and FSDP's working set of gathered groups
(:func:`titanlike.planner.memory.rank_state_memory`; a seed-checkpoint run holds its parameter shards only). The
printed per-rank number is the planner's. Activations are not counted (they depend on the batch and are the user's
to size), so the check refuses only what cannot run at all. On a CUDA device the host holds one parameter shard at
a time while the weights are generated or loaded, so there is no host-memory refusal there (the planner's GPU
memory estimate is a separate check: ``scripts/plan.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from titanlike.planner.layout import Layout
from titanlike.planner.memory import rank_host_memory, rank_state_memory
from titanlike.planner.plan import fmt_bytes

__all__ = ["HOST_FRACTION", "host_memory_bytes", "host_memory_problem", "local_world_size"]

# Share of the physical memory the ranks' training state may take: the rest is for the OS, each rank's Python +
# torch runtime (~0.4 GiB RSS per gloo rank before any model, docs/facts.md), the data and the activations.
HOST_FRACTION = 0.8


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_world_size(world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE`` (1 for a plain process)."""
    return max(1, min(int(env.get("LOCAL_WORLD_SIZE", "1")), world_size))


def host_memory_problem(
    cfg, world_size: int, args, *, local_ranks: int, host_bytes: int, device_type: str = "cpu"
) -> str | None:
    """One line naming the fix when, on a CPU device, the ranks of some node (``local_ranks`` consecutive ranks per
    node, as torchrun places them; every node assumed to have ``host_bytes``) need more than ``HOST_FRACTION`` of
    ``host_bytes``; None when every node fits, and always on another device. Every rank computes the same answer,
    so a job is refused by all its ranks (and reported by rank 0) whichever node is short."""
    if device_type != "cpu":
        return None
    layout = Layout.from_config(cfg, world_size, args, gpus_per_node=local_ranks)
    seed_only = cfg.checkpoint.create_seed_checkpoint  # writes the initial weights and exits: parameters only
    cache: dict[tuple[int, int, int], list] = {}

    def items(rank: int) -> list:
        c = layout.coords(rank)  # a rank's shards depend on its pp stage(s), tp rank and FSDP shard index only
        key = (c["pp"], c["tp"], layout.fsdp_shard_index(c))
        if key not in cache:
            # (under CPU offload the state items are in rank_host_memory: on a CPU device the same memory)
            state = [it for it in rank_state_memory(layout, args, rank) if it.bytes]
            state += [it for it in rank_host_memory(layout, args, rank) if it.name != "offloaded activations"]
            cache[key] = [it for it in state if not seed_only or it.name == "parameters"]
        return cache[key]

    worst_node, worst = None, 0.0
    for first in range(0, world_size, local_ranks):
        node = range(first, min(first + local_ranks, world_size))
        total = sum(it.bytes for r in node for it in items(r))
        if total > HOST_FRACTION * host_bytes and total > worst:
            worst_node, worst = node, total
    if worst_node is None:
        return None
    rank = max(worst_node, key=lambda r: sum(it.bytes for it in items(r)))
    parts = " + ".join(f"{it.name} {fmt_bytes(it.bytes)}" for it in items(rank) if it.bytes)
    n = len(worst_node)
    where = (
        "this host"
        if n == world_size
        else f"node {worst_node[0] // local_ranks} (ranks {worst_node[0]}-{worst_node[-1]}, a host like this one)"
    )
    who = "the one rank on this host needs" if n == 1 else f"the {n} ranks on {where} need"
    return (
        f"host memory: {who} {fmt_bytes(worst)} of "
        f"{'weights' if seed_only else 'state'}, more than {HOST_FRACTION:.0%} of the {fmt_bytes(host_bytes)} "
        f"of host memory (rank {rank}: {fmt_bytes(sum(it.bytes for it in items(rank)))}, planner: {parts}); "
        f"shard it over more ranks on more nodes (a larger dp_shard / tp / pp degree), start fewer ranks per node "
        f"(torchrun --nproc_per_node), or train on GPUs (--training.device cuda)"
    )
