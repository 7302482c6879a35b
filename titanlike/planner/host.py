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
from collections.abc import Mapping, Sequence

from titanlike.planner.layout import Layout
from titanlike.planner.memory import rank_state_memory
from titanlike.planner.plan import fmt_bytes

__all__ = ["HOST_FRACTION", "host_memory_bytes", "host_memory_problem", "node_ranks"]

# Share of the physical memory the ranks' training state may take: the rest is for the OS, each rank's Python +
# torch runtime (~0.4 GiB RSS per gloo rank before any model, docs/facts.md), the data and the activations.
HOST_FRACTION = 0.8


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def node_ranks(world_size: int, env: Mapping[str, str] = os.environ) -> range:
    """The global ranks launched on this node, from torchrun's ``RANK`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``
    (one process without them)."""
    rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    first = rank - local
    return range(first, min(first + int(env.get("LOCAL_WORLD_SIZE", "1")), world_size))


def host_memory_problem(cfg, world_size: int, args, *, ranks: Sequence[int], host_bytes: int,
                        device_type: str = "cpu") -> str | None:
    """One line naming the fix when the state of ``ranks`` (this node's) does not fit ``HOST_FRACTION`` of
    ``host_bytes`` on a CPU device; None when it fits, and always on another device."""
    if device_type != "cpu" or not ranks:
        return None
    layout = Layout.from_config(cfg, world_size, args, gpus_per_node=len(ranks))
    seed_only = cfg.checkpoint.create_seed_checkpoint  # writes the initial weights and exits: parameters only
    items = {r: [it for it in rank_state_memory(layout, args, r) if not seed_only or it.name == "parameters"]
             for r in ranks}
    per_rank = {r: sum(it.bytes for it in its) for r, its in items.items()}
    total = sum(per_rank.values())
    if total <= HOST_FRACTION * host_bytes:
        return None
    worst = max(per_rank, key=per_rank.get)
    parts = " + ".join(f"{it.name} {fmt_bytes(it.bytes)}" for it in items[worst] if it.bytes)
    n = len(ranks)
    return (f"host memory: rank {worst} holds {fmt_bytes(per_rank[worst])} of {'weights' if seed_only else 'state'} "
            f"(planner: {parts}); this node's {n} rank{'s' * (n > 1)} need {fmt_bytes(total)}, more than "
            f"{HOST_FRACTION:.0%} of the {fmt_bytes(host_bytes)} of host memory; shard it over more ranks on more "
            f"nodes (a larger dp_shard / tp / pp degree), start fewer ranks per node (torchrun --nproc_per_node), "
            f"or train on GPUs (--training.device cuda)")
