"""4 gloo ranks: every rank's generated shard equals its part of the whole tensor (tests/init/test_init.py)."""

import itertools
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from titanlike.init import generate, init_parameters, local_indices, normal, trunc_normal, zeros
from titanlike.parallel.fused import (
    FusedColwiseParallel,
    fsdp_placement,
    gather_strided,
    is_strided,
    prepare_fused_for_fsdp,
)
from titanlike.parallel.materialize import to_empty_keeping_ties

PLAN = {r".*bias": zeros(), r"0\..*": normal(0.3), r"1\..*": trunc_normal(0.1), r".*": normal(1.0)}


def check_local_indices(rank: int) -> int:
    n = 0
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shapes = [(5,), (3,), (13, 6), (6, 13), (2, 9), (12, 7), (4, 3, 11)]
    one = [Shard(0), Shard(1), Shard(-1), Replicate(), _StridedShard(0, split_factor=3)]
    two = [Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
    for shape in shapes:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        cases = [(mesh1, [p]) for p in one] + [(mesh2, list(p)) for p in itertools.product(two, two)]
        for mesh, placements in cases:
            sharded = [p for p in placements if p.is_shard() or isinstance(p, _StridedShard)]
            if any(p.dim >= len(shape) for p in sharded):
                continue
            if any(isinstance(p, _StridedShard) and shape[p.dim] % p.split_factor for p in sharded):
                continue
            dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
            idx = local_indices(dt)
            mine = full
            for d, ix in enumerate(idx):
                mine = mine.index_select(d, ix)
            assert torch.equal(mine, dt.to_local()), (rank, shape, placements)
            n += 1
    return n


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 10)  # uneven over 4 (10 rows) and 2 x 2
        self.b = nn.Linear(10, 6)
        self.c = nn.Linear(6, 12)  # fused-chunk target: 3 chunks of 4 rows (FSDP shards it on dim 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def build(kind: str, mesh1, mesh2) -> nn.Module:
    with torch.device("meta"):
        m = nn.Sequential(Net(), nn.Linear(12, 3)).double()
    if kind == "fsdp4":
        fully_shard(m[0], mesh=mesh1)
        fully_shard(m, mesh=mesh1)
    elif kind == "tp2_fsdp2":
        parallelize_module(
            m[0], mesh2["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel(), "c": FusedColwiseParallel(3)}
        )
        prepare_fused_for_fsdp(m[0])
        fully_shard(m[0], mesh=mesh2["dp"], shard_placement_fn=fsdp_placement)
        fully_shard(m, mesh=mesh2["dp"])
    to_empty_keeping_ties(m, torch.device("cpu"))
    return m


def main(rank: int, world: int, out: str | None = None) -> None:
    """Every check; rank 0 prints the count, and writes it to ``out`` as JSON (tests/parallel/shared_launch.py)."""
    n = check_local_indices(rank)
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reference = nn.Sequential(Net(), nn.Linear(12, 3)).double()
    init_parameters(reference, PLAN, seed=11)
    expect = dict(reference.named_parameters())
    for kind in ("fsdp4", "tp2_fsdp2"):
        m = build(kind, mesh1, mesh2)
        init_parameters(m, PLAN, seed=11)
        for name, p in m.named_parameters():
            # a chunk-sharded parameter through gather_strided (torch 2.11's full_tensor() refuses its placements)
            full = (gather_strided(p) if is_strided(p) else p).full_tensor()
            assert torch.equal(full, expect[name]), (kind, name)
            n += 1
    # the single-device values are those of generate() on the whole tensor
    assert torch.equal(expect["1.weight"], generate(trunc_normal(0.1), 11, "1.weight", (3, 12), dtype=torch.float64))
    if rank == 0:
        print(f"checked {n} local layouts / parameters", flush=True)
        if out is not None:
            Path(out).write_text(json.dumps({"checked": n}))


if __name__ == "__main__":
    from dist_utils import spawn

    sys.exit(spawn(main, 4, timeout_s=120))
