"""Parallel degrees, the device mesh they define, and the rank grid as plain Python.

Mesh layout: one 5-D mesh with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, row-major, so **tp is
innermost** (consecutive ranks form a tp group, which keeps tensor parallelism inside a node) and pp outermost.
Every dim is kept, size-1 ones included, so ``mesh["tp"]`` or ``mesh["pp"]`` always exists and code never
branches on which dims happen to be active (a size-1 group costs nothing at run time and ~1 ms to create).
Three flattened dims are added to the root mesh:

* ``"dp"`` = dp_replicate x dp_shard: data loading (which slice of the global batch a rank reads) and the
  token-count / loss all-reduces;
* ``"dp_shard_cp"`` = dp_shard x cp: the dim FSDP shards parameters over;
* ``"dp_cp"`` = dp_replicate x dp_shard x cp: every rank that holds the same model shard (gradient reduction).

Rank of mesh coordinate ``(pp, dp_replicate, dp_shard, cp, tp)``::

    (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t

:func:`rank_groups` and :func:`describe_layout` compute the same grid without a process group, for planners.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field

from titanlike.config import ConfigError, JobConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}
_BUILT: dict[tuple, dict] = {}  # (shape, device type, default process group) -> meshes, see build_mesh


@dataclass
class ParallelDims:
    """Parallel degrees whose product is the world size; ``dp_shard=-1`` takes whatever is left."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("dp_replicate", "cp", "tp", "pp", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ParallelDims: {name} must be >= 1, got {getattr(self, name)}")
        rest = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ConfigError(f"ParallelDims: world size {self.world_size} is not divisible by pp {self.pp} x "
                                  f"dp_replicate {self.dp_replicate} x cp {self.cp} x tp {self.tp} = {rest}; "
                                  f"change the degrees or the number of processes")
            self.dp_shard = self.world_size // rest
        elif self.dp_shard < 1:
            raise ConfigError(f"ParallelDims: dp_shard must be -1 (infer) or >= 1, got {self.dp_shard}")
        if rest * self.dp_shard != self.world_size:
            raise ConfigError(f"ParallelDims: pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
                              f"{self.dp_shard} x cp {self.cp} x tp {self.tp} = {rest * self.dp_shard} != world size "
                              f"{self.world_size}; set dp_shard=-1 to infer it or change the degrees")

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        p = cfg.parallelism
        return cls(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                   cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                   world_size=world_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_DIMS`` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are read per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard x cp)."""
        return self.dp_shard * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def build_mesh(self, device_type: str):
        """The 5-D mesh (see the module docstring), with the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` dims.

        Needs an initialised default process group of ``world_size`` ranks. Collective: every rank must call it.
        Take submeshes with :meth:`get_mesh` (it keeps the flattened meshes: slicing a flattened dim from the
        root mesh, ``mesh["dp"]``, still works but is deprecated since torch 2.11). Building the same shape again
        in the same process group returns the same meshes (no new process groups).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"ParallelDims: built for world size {self.world_size} but the process group has "
                              f"{dist.get_world_size()} ranks")
        key = (self.shape, device_type, dist.group.WORLD)
        if key not in _BUILT:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
            meshes = {"world": mesh, **{name: mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}}
            if self.cp > 1 and self.dp_replicate > 1:  # HSDP under cp: (dp_replicate, dp_shard x cp), 2-D
                meshes[("dp_replicate", "dp_shard_cp")] = meshes["dp_cp"]._unflatten(
                    0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp"))
            _BUILT[key] = meshes
        self._meshes = _BUILT[key]
        return self._meshes["world"]

    @property
    def world_mesh(self):
        """The mesh :meth:`build_mesh` returned."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.world_mesh: call build_mesh(device_type) first")
        return self._meshes["world"]

    def get_mesh(self, names: str | tuple[str, ...]):
        """A submesh of :meth:`build_mesh`'s mesh: one dim or flattened dim (``"tp"``, ``"dp"``, ``"dp_shard_cp"``)
        or several plain dims in mesh order (``("dp_replicate", "dp_shard")``). ``"dp_shard_cp"`` is ``"dp_shard"``
        while cp is 1, so ``("dp_replicate", "dp_shard_cp")`` (the HSDP mesh) works then too."""
        world = self.world_mesh
        names = (names,) if isinstance(names, str) else tuple(names)
        if self.cp == 1:
            names = tuple("dp_shard" if n == "dp_shard_cp" else n for n in names)
        if len(names) == 1 and names[0] in FLATTENED:
            return self._meshes[names[0]]
        if names in self._meshes:  # ("dp_replicate", "dp_shard_cp") under cp: HSDP's mesh
            return self._meshes[names]
        if any(n not in MESH_DIMS for n in names):
            raise ValueError(f"ParallelDims.get_mesh: {names} must be one of {tuple(FLATTENED)} or dims of "
                             f"{MESH_DIMS}")
        return world[names]


def rank_of(dims: ParallelDims, coord: dict[str, int]) -> int:
    """Global rank of a mesh coordinate (missing dims count as 0)."""
    rank = 0
    for name, size in zip(MESH_DIMS, dims.shape):
        rank = rank * size + coord.get(name, 0)
    return rank


def rank_groups(dims: ParallelDims, names: str | tuple[str, ...]) -> list[list[int]]:
    """The process groups of a mesh dim, or of several dims flattened (e.g. "tp", "dp", ("dp_shard", "cp")).

    Each group lists the ranks that differ only in ``names`` (in rank order); groups are sorted by their first rank.
    """
    if isinstance(names, str):
        names = FLATTENED.get(names, (names,))
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ValueError(f"rank_groups: unknown mesh dims {unknown}; valid: {MESH_DIMS + tuple(FLATTENED)}")
    sizes = dict(zip(MESH_DIMS, dims.shape))
    fixed = [n for n in MESH_DIMS if n not in names]
    groups = []
    for outer in itertools.product(*(range(sizes[n]) for n in fixed)):
        base = dict(zip(fixed, outer))
        groups.append(sorted(rank_of(dims, {**base, **dict(zip(names, inner))})
                             for inner in itertools.product(*(range(sizes[n]) for n in names))))
    return sorted(groups)


def _default_gpus_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 0


def describe_layout(dims: ParallelDims, gpus_per_node: int | None = None) -> str:
    """Human-readable layout: degrees, world size, which ranks form each tp / cp / dp / pp group, and a WARNING
    line for every tp group that spans nodes (nodes = consecutive blocks of ``gpus_per_node`` ranks; default
    ``LOCAL_WORLD_SIZE``, else one node holding every rank)."""
    gpn = gpus_per_node or _default_gpus_per_node() or dims.world_size
    degrees = " x ".join(f"{n} {s}" for n, s in zip(MESH_DIMS, dims.shape))
    n_nodes = math.ceil(dims.world_size / gpn)
    lines = [f"parallel layout: {degrees} = world size {dims.world_size} "
             f"({n_nodes} node{'s' if n_nodes > 1 else ''} of {gpn} rank{'s' if gpn > 1 else ''})"]

    def fmt(groups):
        return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)

    for label, names in (("tp", "tp"), ("cp", "cp"), ("dp_shard (fsdp)", "dp_shard"),
                         ("dp_replicate", "dp_replicate"), ("dp (data)", "dp"), ("pp", "pp")):
        size = math.prod(dict(zip(MESH_DIMS, dims.shape))[n] for n in FLATTENED.get(names, (names,)))
        if size > 1:
            lines.append(f"  {label} groups of {size}: {fmt(rank_groups(dims, names))}")
    if dims.world_size == 1:
        lines.append("  single rank: no parallelism")
    for group in rank_groups(dims, "tp"):
        nodes = sorted({r // gpn for r in group})
        if len(nodes) > 1:
            lines.append(f"WARNING: tp group [{','.join(map(str, group))}] spans nodes {nodes}: every layer's "
                         f"tensor-parallel collectives cross the inter-node link; keep tp <= gpus_per_node ({gpn})")
    return "\n".join(lines)
