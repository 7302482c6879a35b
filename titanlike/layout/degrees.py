"""Parallel degrees and the rank grid they define, as plain numbers (no process group).

Mesh layout: one 5-D mesh with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, row-major, so **tp is
innermost** (consecutive ranks form a tp group, which keeps tensor parallelism inside a node) and pp outermost.
Three flattened dims are derived from it:

* ``"dp"`` = dp_replicate x dp_shard: data loading (which slice of the global batch a rank reads) and the
  token-count / loss all-reduces;
* ``"dp_shard_cp"`` = dp_shard x cp: the dim FSDP shards parameters over.
* ``"dp_cp"`` = dp_replicate x dp_shard x cp: every rank that holds the same model shard (the loss / token-count
  group under cp; HSDP's 2-D mesh under cp is unflattened from it).

Rank of mesh coordinate ``(pp, dp_replicate, dp_shard, cp, tp)``::

    (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t

``titanlike.parallel.ParallelDims`` adds the device mesh to :class:`Degrees`; :func:`rank_groups` and
:func:`describe_layout` compute the same grid in pure Python, for planners and for the trainer's layout print.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

from titanlike.errors import ConfigError

__all__ = [
    "FLATTENED",
    "MESH_DIMS",
    "TOKEN_DIMS",
    "Degrees",
    "degree_problems",
    "describe_layout",
    "expert_degree_problem",
    "expert_groups",
    "rank_groups",
    "rank_of",
]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# The ranks holding other tokens of the same layers: every data and context rank, and the tp ranks too where they
# route their own sequence shards (expert parallelism borrowing tp under sequence parallelism).
TOKEN_DIMS = {"dp_cp": FLATTENED["dp_cp"], "dp_cp_tp": (*FLATTENED["dp_cp"], "tp")}


def degree_problems(
    *, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, world_size: int
) -> tuple[list[str], int]:
    """The degree arithmetic: (one line per problem, the resolved dp_shard). ``dp_shard = -1`` takes whatever
    the other degrees leave of ``world_size``. The resolved value is 1 where it cannot be resolved."""
    out = []
    for name, value in (
        ("data_parallel_replicate_degree", dp_replicate),
        ("context_parallel_degree", cp),
        ("tensor_parallel_degree", tp),
        ("pipeline_parallel_degree", pp),
    ):
        if value < 1:
            out.append(f"parallelism.{name}: {value} must be >= 1")
    if world_size < 1:
        out.append(f"world size {world_size} must be >= 1")
    if out:
        return out, 1
    rest = tp * pp * cp * dp_replicate
    if dp_shard == -1:
        if world_size % rest:
            return [
                f"parallelism: world size {world_size} is not divisible by tp {tp} x pp {pp} x cp {cp} x "
                f"dp_replicate {dp_replicate} = {rest}; change the degrees or the number of processes"
            ], 1
        return [], world_size // rest
    if dp_shard < 1:
        return [f"parallelism.data_parallel_shard_degree: {dp_shard} must be -1 (infer) or >= 1"], 1
    if rest * dp_shard != world_size:
        return [
            f"parallelism: pp {pp} x dp_replicate {dp_replicate} x dp_shard {dp_shard} x cp {cp} x tp {tp} = "
            f"{rest * dp_shard} != world size {world_size}; set data_parallel_shard_degree = -1 to infer it or "
            f"change the degrees"
        ], dp_shard
    return [], dp_shard


@dataclass
class Degrees:
    """Parallel degrees whose product is the world size; ``dp_shard=-1`` takes whatever is left."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    # expert parallelism: borrows ranks from dp_shard x cp, and from tp too when tp > 1 (sequence parallelism splits
    # the tokens over the tp ranks; the layout rules require it): the routed experts split over them
    ep: int = 1

    def __post_init__(self):
        problems, self.dp_shard = degree_problems(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            world_size=self.world_size,
        )
        if problems:
            raise ConfigError.of(problems)
        problem = expert_degree_problem(self.ep, self.dp_shard, self.cp, self.tp if self.ep > 1 else 1)
        if problem:
            raise ConfigError(problem)

    @classmethod
    def from_config(cls, cfg, world_size: int):
        """The degrees of ``cfg.parallelism`` on ``world_size`` ranks."""
        p = cfg.parallelism
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=world_size,
            ep=p.expert_parallel_degree,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_DIMS`` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are read per step."""
        return self.dp_replicate * self.dp_shard

    # A dim is enabled when its degree is above 1.
    dp_enabled = property(lambda self: self.dp > 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    pp_enabled = property(lambda self: self.pp > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    ep_enabled = property(lambda self: self.ep > 1)

    @property
    def ep_tp(self) -> int:
        """The tp ranks expert parallelism borrows: all of them when ep > 1 and tp > 1 (under sequence parallelism
        each tp rank holds other tokens of the residual stream, which its MoE blocks route on their own), else 1."""
        return self.tp if self.ep > 1 and self.tp > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ranks of ``dp_shard x cp`` (``x tp`` when borrowed: :attr:`ep_tp`) holding the same experts (the
        experts' FSDP group): ``dp_shard * cp * ep_tp / ep``."""
        return self.dp_shard * self.cp * self.ep_tp // self.ep

    @property
    def expert_load_dim(self) -> str | None:
        """The flattened mesh dim whose ranks routed other tokens of the same MoE layers (the expert loads and the
        aux-loss terms are summed over it once per step): ``"dp_cp"`` (dp x cp), ``"dp_cp_tp"`` when expert
        parallelism borrows tp (:data:`TOKEN_DIMS`); None on one rank per model copy."""
        name = "dp_cp_tp" if self.ep_tp > 1 else "dp_cp"
        return name if math.prod(self.shape[MESH_DIMS.index(d)] for d in TOKEN_DIMS[name]) > 1 else None

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard x cp)."""
        return self.dp_shard * self.cp > 1

    @property
    def fsdp_wraps(self) -> bool:
        """The model is wrapped by FSDP2: sharded, or HSDP with a shard group of one (replicated data parallel).
        One rank per model copy gets no FSDP at all (see docs/facts.md, "FSDP on one rank")."""
        return self.fsdp_enabled or self.dp_replicate_enabled

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinate of ``rank``."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(MESH_DIMS, self.shape))):
            out[name] = rest % size
            rest //= size
        return out

    def pp_rank_of(self, rank: int) -> int:
        return rank // (self.world_size // self.pp)


def expert_degree_problem(ep: int, dp_shard: int, cp: int, tp: int = 1) -> str | None:
    """One line when the expert-parallel degree cannot borrow its ranks from ``dp_shard x cp`` (``x tp``: tp > 1
    under sequence parallelism), else None."""
    if ep < 1:
        return f"parallelism.expert_parallel_degree: {ep} must be >= 1"
    borrowed = dp_shard * cp * tp
    if ep > 1 and borrowed % ep:
        what = f"dp_shard {dp_shard} x cp {cp}" + (f" x tp {tp}" if tp > 1 else "")
        return (
            f"parallelism.expert_parallel_degree {ep} does not divide {what} = {borrowed} "
            f"(expert parallelism borrows its ranks from them); choose a divisor of {borrowed}"
        )
    return None


def expert_groups(dims: Degrees) -> list[list[int]]:
    """The expert-parallel groups: each ``dp_shard x cp`` (``x tp`` when borrowed) group (ranks in mesh order) cut
    into consecutive blocks of ``ep`` ranks (ep innermost, as :class:`titanlike.parallel.ParallelDims` unflattens
    it)."""
    borrowed = ("dp_shard", "cp", "tp") if dims.ep_tp > 1 else ("dp_shard", "cp")
    return sorted(g[i : i + dims.ep] for g in rank_groups(dims, borrowed) for i in range(0, len(g), dims.ep))


def rank_of(dims: Degrees, coord: dict[str, int]) -> int:
    """Global rank of a mesh coordinate (missing dims count as 0)."""
    rank = 0
    for name, size in zip(MESH_DIMS, dims.shape):
        rank = rank * size + coord.get(name, 0)
    return rank


def rank_groups(dims: Degrees, names: str | tuple[str, ...]) -> list[list[int]]:
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
        groups.append(
            sorted(
                rank_of(dims, {**base, **dict(zip(names, inner))})
                for inner in itertools.product(*(range(sizes[n]) for n in names))
            )
        )
    return sorted(groups)


def describe_layout(dims: Degrees, gpus_per_node: int | None = None) -> str:
    """Human-readable layout: degrees, world size, which ranks form each tp / cp / dp / pp group, and a WARNING
    line for every tp group that spans nodes (nodes = consecutive blocks of ``gpus_per_node`` ranks; default
    ``LOCAL_WORLD_SIZE``, else one node holding every rank)."""
    gpn = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or dims.world_size
    degrees = " x ".join(f"{n} {s}" for n, s in zip(MESH_DIMS, dims.shape))
    n_nodes = math.ceil(dims.world_size / gpn)
    lines = [
        f"parallel layout: {degrees} = world size {dims.world_size} "
        f"({n_nodes} node{'s' if n_nodes > 1 else ''} of {gpn} rank{'s' if gpn > 1 else ''})"
    ]

    def fmt(groups):
        return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)

    for label, names in (
        ("tp", "tp"),
        ("cp", "cp"),
        ("dp_shard (fsdp)", "dp_shard"),
        ("dp_replicate", "dp_replicate"),
        ("dp (data)", "dp"),
        ("pp", "pp"),
    ):
        size = math.prod(dict(zip(MESH_DIMS, dims.shape))[n] for n in FLATTENED.get(names, (names,)))
        if size > 1:
            lines.append(f"  {label} groups of {size}: {fmt(rank_groups(dims, names))}")
    if dims.ep > 1:
        lines.append(
            f"  ep groups of {dims.ep} (experts sharded; FSDP of the experts over the other "
            f"{dims.dp_shard_mod_ep}): {fmt(expert_groups(dims))}"
        )
    if dims.world_size == 1:
        lines.append("  single rank: no parallelism")
    for group in rank_groups(dims, "tp"):
        nodes = sorted({r // gpn for r in group})
        if len(nodes) > 1:
            lines.append(
                f"WARNING: tp group [{','.join(map(str, group))}] spans nodes {nodes}: every layer's "
                f"tensor-parallel collectives cross the inter-node link; keep tp <= gpus_per_node ({gpn})"
            )
    return "\n".join(lines)
