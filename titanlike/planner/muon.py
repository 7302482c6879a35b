"""What Muon's optimizer step costs a rank: the matrices it orthogonalizes, their Newton-Schulz FLOPs, the
elements its all-to-alls send and receive, and the full matrices it holds at once.

The owners and buckets are ``titanlike.layout.muon``'s (the optimizer, ``titanlike.parallel.muon``, acts on the
same function): the matrices of a pipeline stage, in the optimizer's order, are owned round-robin by the stage's
``dp_replicate x dp_shard x cp x tp`` ranks (its group, in rank order) whenever its parameters are DTensors (FSDP
or TP on), else by the rank itself. A rank's block of a matrix is its local rows x columns of the parameter
(``titanlike.sharding.param_dims``: tp splits the tp dim, per chunk for an equal-chunk fused projection, then FSDP
splits the tp-local tensor, both like ``torch.chunk``) that fall in the matrix's box. Per matrix ``m`` of full size
``N`` and this rank's block ``n``:

* the owner receives ``N - n`` (the blocks of its replica set: ranks with its coordinates on the dims that
  replicate the parameter, dp_replicate and, for a tp-replicated weight, tp) and sends ``R N - n`` back (every
  rank of the group its block; ``R`` replica sets);
* every other rank sends its ``n`` (if it is in the owner's replica set) and receives ``n``.

``tests/parallel/test_parallel_gate.py`` checks these numbers against what the real optimizer counted
(``Muon.stats``) under every Muon layout of the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlike.layout.muon import ns_flops, plan_buckets
from titanlike.models import spec_for
from titanlike.planner.layout import Layout
from titanlike.planner.memory import chunk, param_shapes
from titanlike.sharding import FusedColwise, entry_for, param_dims

__all__ = ["MuonRank", "muon_rank"]


@dataclass(frozen=True)
class MuonRank:
    """One rank's Muon step (elements in the Newton-Schulz dtype)."""

    matrices: int  # matrices this rank orthogonalizes
    ns_flops: int  # their Newton-Schulz FLOPs
    collectives: int  # all-to-alls (2 per bucket of a distributed group)
    sent: int  # elements sent to other ranks
    received: int  # elements received from other ranks
    group: int  # ranks sharing the matrices (1: the rank's own)
    largest_owned: int  # elements of the full matrices this rank owns in its largest bucket


Ranges = list[tuple[int, int]]  # increasing, disjoint [start, stop) runs of global indices


def _take(ranges: Ranges, start: int, stop: int) -> Ranges:
    """Positions ``start:stop`` of the indices ``ranges`` lists (in order)."""
    out, pos = [], 0
    for a, b in ranges:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _count(ranges: Ranges, a: int, b: int) -> int:
    return sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in ranges)


def _split(ranges: Ranges, parts: int, index: int) -> Ranges:
    """This piece when ``torch.chunk`` / ``Shard`` splits the indices into ``parts``."""
    n = sum(b - a for a, b in ranges)
    start = min(n, -(-n // parts) * index)
    return _take(ranges, start, start + chunk(n, parts, index))


def _index_sets(lo: Layout, entry, shape, dims: tuple[int | None, int], c: dict[str, int]) -> list[Ranges]:
    """This rank's global indices per dim of a parameter of ``shape`` with (tp dim, FSDP dim) ``dims``: tp's split
    (each chunk's for an equal-chunk fused projection), then FSDP's of the tp-local tensor."""
    tp_dim, fsdp_dim = dims
    idx: list[Ranges] = [[(0, n)] for n in shape]
    if tp_dim is not None:
        k = entry.sizes(shape[tp_dim]) if isinstance(entry, FusedColwise) else 1  # equal chunks here (tp-sharded)
        piece = shape[tp_dim] // k
        idx[tp_dim] = [r for j in range(k) for r in _split([(j * piece, (j + 1) * piece)], lo.tp, c["tp"])]
    if lo.fsdp:
        idx[fsdp_dim] = _split(idx[fsdp_dim], lo.fsdp_shard, lo.fsdp_shard_index(c))
    return idx


_STAGES: dict[tuple, list] = {}


def _stage_matrices(lo: Layout, args, names: tuple[str, ...]) -> list:
    """(shape, entry, boxes, (tp dim, FSDP dim)) of every Muon parameter of the stage holding ``names``, in the
    optimizer's order (the stage's ``named_parameters``)."""
    key = (repr(args), names, lo.tp, lo.fsdp)
    if key not in _STAGES:
        if len(_STAGES) > 16:
            _STAGES.clear()
        sharding, out = spec_for(args).sharding_of(args), []
        for name, shape in param_shapes(args, names).items():
            owner, _, leaf = name.rpartition(".")
            entry = entry_for(sharding, owner)
            boxes = entry.matrices(leaf, tuple(shape)) if entry is not None else None
            if boxes:
                out.append((shape, entry, boxes, param_dims(sharding, name, len(shape), tp=lo.tp, fsdp=lo.fsdp)))
        _STAGES[key] = out
    return _STAGES[key]


def muon_rank(lo: Layout, args, rank: int = 0) -> MuonRank | None:
    """``rank``'s Muon step under ``lo`` (None under AdamW)."""
    if lo.optimizer != "Muon":
        return None
    c = lo.coords(rank)
    distributed = lo.fsdp or lo.tp > 1
    group = lo.world_size // lo.pp if distributed else 1
    base = lo.pp_rank_of(rank) * (lo.world_size // lo.pp)
    me = rank - base if distributed else 0
    mats = []  # (rows, cols, full numel, my block's numel, replicated over tp)
    for sid in lo.stage_ids(lo.pp_rank_of(rank)):
        for shape, entry, boxes, dims in _stage_matrices(lo, args, tuple(lo.stages[sid])):
            idx = _index_sets(lo, entry, shape, dims, c)
            for box in boxes:
                mine = 1
                for ranges, (a, b) in zip(idx, box):
                    mine *= _count(ranges, a, b)
                rows, cols = box[-2][1] - box[-2][0], box[-1][1] - box[-1][0]
                mats.append((rows, cols, rows * cols, mine, dims[0] is None))
    buckets = plan_buckets([m[2] * lo.ns_bytes for m in mats], group, lo.muon_bucket_mb * 2**20)
    owned = flops = sent = received = largest = 0
    for bucket in buckets:
        in_bucket = 0
        for k, owner in zip(bucket.items, bucket.owners):
            rows, cols, full, mine, tp_replicated = mats[k]
            if owner == me:
                owned, flops, in_bucket = owned + 1, flops + ns_flops(rows, cols, lo.ns_steps), in_bucket + full
                replicas = (lo.dp_replicate if lo.fsdp else 1) * (lo.tp if tp_replicated else 1)
                received += full - mine
                sent += replicas * full - mine
            else:
                oc = lo.coords(base + owner)
                same_set = (not lo.fsdp or oc["dp_replicate"] == c["dp_replicate"]) and (
                    not tp_replicated or oc["tp"] == c["tp"]
                )
                sent += mine if same_set else 0
                received += mine
        largest = max(largest, in_bucket)
    return MuonRank(
        matrices=owned,
        ns_flops=flops,
        collectives=2 * len(buckets) if group > 1 else 0,
        sent=sent if group > 1 else 0,
        received=received if group > 1 else 0,
        group=group,
        largest_owned=largest,
    )
