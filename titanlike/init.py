"""Sharded, layout-independent initialization: every weight is a pure function of (seed, FQN, element index).

A fresh start never materialises the whole model. The trainer builds it on the meta device, parallelizes it (TP,
FSDP/HSDP, pipeline stages, CP), allocates this rank's shards and fills each with :func:`init_parameters`, which
generates only the elements the rank holds. The single-device init (``model.init_weights()``) calls the same
function on full tensors, so every layout starts from bit-identical weights, and the peak host memory of the init
is one parameter's local shard (plus one tile), never the model.

**How an element's value is made.** A parameter of global shape ``S`` is cut into fixed tiles (:func:`tile_shape`:
``TILE_ROWS x TILE_COLS`` over the last two dims, ``TILE_1D`` elements for a vector, one index of every leading
dim). Tile ``t`` is filled by its own CPU ``torch.Generator`` seeded with a hash of ``(seed, key, t)`` (``key``:
the parameter's FQN, or the FQN it is tied to), so any tile can be produced alone. A rank's local tensor is the
Cartesian product of one index list per dim (:func:`local_indices`, derived from the DTensor's placements with
torch's own split rules, ``Shard`` and ``_StridedShard``, uneven last shards included); the init generates the
tiles those lists touch and copies the wanted elements out. Values are drawn on the CPU (normal: float32 draws,
6x faster than float64 ones, scaled in float64) and cast to the parameter's dtype and device, so float64, float32
and bf16 runs, CPU and GPU, start from the same point.

**Distributions** (:class:`Init`): ``normal(std)``, ``trunc_normal(std, a, b)`` (torch's inverse-CDF method, per
tile), ``zeros()``, ``ones()``, ``constant(v)``. Each model spec declares its parameters' distributions
(``ModelSpec.param_init``); a tied copy names its owner with ``Init.key`` (the last pipeline stage's copy of a tied
embedding is generated as the embedding itself).

Any module can use it: ``init_parameters(module, {"regex": Init, ...} or fn(fqn) -> Init, seed)`` on a plain or
parallelized module (DTensor parameters, FSDP2 included).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = [
    "Init",
    "log_uniform",
    "normal",
    "trunc_normal",
    "zeros",
    "ones",
    "constant",
    "init_parameters",
    "generate",
    "local_indices",
    "tile_shape",
    "plan_from_patterns",
    "canonical_fqn",
    "InitPlanError",
]

TILE_ROWS, TILE_COLS = 128, 256  # 32,768 elements: ~0.25 MB of float64 per tile
TILE_1D = 32768


class InitPlanError(ValueError):
    """A parameter the init plan has no distribution for (one line naming it)."""


@dataclass(frozen=True)
class Init:
    kind: str  # normal | trunc_normal | zeros | ones | constant | log_uniform (log of uniform on [a, b])
    std: float = 1.0
    mean: float = 0.0
    a: float = -2.0  # trunc_normal bounds (absolute values, as nn.init.trunc_normal_)
    b: float = 2.0
    value: float = 0.0  # constant
    key: str | None = None  # the FQN whose values these are (a tied copy names its owner); None: the parameter's own

    def __post_init__(self):
        if self.kind not in ("normal", "trunc_normal", "zeros", "ones", "constant", "log_uniform"):
            raise ValueError(f"Init: unknown kind '{self.kind}'")

    def tied_to(self, key: str) -> Init:
        return replace(self, key=key)


def normal(std: float, mean: float = 0.0) -> Init:
    return Init("normal", std=std, mean=mean)


def trunc_normal(std: float, a: float = -2.0, b: float = 2.0, mean: float = 0.0) -> Init:
    return Init("trunc_normal", std=std, mean=mean, a=a, b=b)


def log_uniform(low: float, high: float) -> Init:
    """``log(u)``, ``u`` uniform on ``[low, high]`` (Mamba's and Gated DeltaNet's ``A_log``)."""
    return Init("log_uniform", a=low, b=high)


def zeros() -> Init:
    return Init("zeros")


def ones() -> Init:
    return Init("ones")


def constant(value: float) -> Init:
    return Init("constant", value=value)


# ---------------------------------------------------------------------------------------------- generation
def tile_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The tile of a tensor of ``shape``: rows x cols over the last two dims, 1 along every leading dim."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_1D,)
    return (1,) * (len(shape) - 2) + (TILE_ROWS, TILE_COLS)


def _tile_seed(seed: int, key: str, shape: Sequence[int], coords: Sequence[int]) -> int:
    text = f"{int(seed)}|{key}|{tuple(shape)}|{tuple(coords)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _normal_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _tile(init: Init, seed: int, key: str, shape: Sequence[int], coords: Sequence[int]) -> torch.Tensor:
    """Tile ``coords`` of the tensor, float64 on the CPU (clipped at the tensor's edge)."""
    tshape = tile_shape(shape)
    size = [min(t, n - c * t) for t, n, c in zip(tshape, shape, coords)]
    g = torch.Generator().manual_seed(_tile_seed(seed, key, shape, coords))
    if init.kind == "normal":
        # float32 draws (6x faster than float64 ones on the CPU), scaled in float64
        return torch.randn(size, generator=g, dtype=torch.float32).to(torch.float64).mul_(init.std).add_(init.mean)
    if init.kind == "log_uniform":
        return torch.rand(size, generator=g, dtype=torch.float64).mul_(init.b - init.a).add_(init.a).log_()
    # trunc_normal: nn.init.trunc_normal_'s method (uniform on [2l-1, 2u-1], erfinv), tile by tile
    lo, hi = _normal_cdf((init.a - init.mean) / init.std), _normal_cdf((init.b - init.mean) / init.std)
    t = torch.rand(size, generator=g, dtype=torch.float64).mul_(2 * hi - 2 * lo).add_(2 * lo - 1)
    return t.erfinv_().mul_(init.std * math.sqrt(2.0)).add_(init.mean).clamp_(init.a, init.b)


def _groups(ix: torch.Tensor, tile: int) -> list[tuple[int, slice, torch.Tensor | slice]]:
    """Split a sorted index list into (tile id, slice of the local dim, offsets inside the tile)."""
    if ix.numel() == 0:
        return []
    tiles = torch.div(ix, tile, rounding_mode="floor")
    ids, counts = torch.unique_consecutive(tiles, return_counts=True)
    out, start = [], 0
    for tid, cnt in zip(ids.tolist(), counts.tolist()):
        sub = ix[start : start + cnt] - tid * tile
        first, last = int(sub[0]), int(sub[-1])
        within = slice(first, last + 1) if last - first + 1 == cnt else sub  # contiguous: a view
        out.append((tid, slice(start, start + cnt), within))
        start += cnt
    return out


def generate(
    init: Init,
    seed: int,
    key: str,
    shape: Sequence[int],
    index: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The elements ``index`` (one sorted index list per dim; None: all) of the tensor of global ``shape`` that
    ``init`` makes from ``(seed, key)``: a tensor of shape ``[len(i) for i in index]`` (written into ``out`` when
    given, whatever its device and dtype)."""
    shape = tuple(int(n) for n in shape)
    if index is None:
        index = [torch.arange(n) for n in shape]
    local_shape = [len(i) for i in index]
    if out is None:
        out = torch.empty(local_shape, dtype=dtype)
    elif list(out.shape) != local_shape:
        raise ValueError(f"generate: out has shape {tuple(out.shape)}, the index lists give {tuple(local_shape)}")
    if init.kind in ("zeros", "ones", "constant"):
        out.fill_({"zeros": 0.0, "ones": 1.0}.get(init.kind, init.value))
        return out
    if out.numel() == 0:
        return out
    if len(shape) == 0:
        out.copy_(_tile(init, seed, key, (1,), (0,)).reshape(()))
        return out
    tshape = tile_shape(shape)
    per_dim = [_groups(ix, t) for ix, t in zip(index, tshape)]
    for combo in itertools.product(*per_dim):
        tile = _tile(init, seed, key, shape, [c[0] for c in combo])
        for d, (_, _, within) in enumerate(combo):
            tile = tile[(slice(None),) * d + (within,)] if isinstance(within, slice) else tile.index_select(d, within)
        out[tuple(c[1] for c in combo)].copy_(tile)
    return out


# ---------------------------------------------------------------------------------------------- shards
def local_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, the sorted global indices this rank's local tensor of ``t`` holds (all of them for a plain tensor).

    A DTensor's local tensor is the Cartesian product of these lists: every mesh dim, in order, splits the list of
    the tensor dim it shards with the placement's own split (``Shard``: ``torch.chunk``, uneven last shards and
    empty ones included; ``_StridedShard``: the r-th piece of each of ``split_factor`` pieces).
    """
    idx = [torch.arange(n) for n in t.shape]
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return idx
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return [i[:0] for i in idx]
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, _StridedShard):
            split = _StridedShard(0, split_factor=p.split_factor)
        elif p.is_shard():
            split = type(p)(0)
        else:  # Replicate / Partial: the whole dim
            continue
        d = p.dim % t.ndim
        pieces, _ = split._split_tensor(idx[d], mesh.size(mesh_dim), with_padding=False, contiguous=True)
        idx[d] = pieces[coord[mesh_dim]] if coord[mesh_dim] < len(pieces) else idx[d][:0]
    return idx


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    """The plain model's FQN of a parameter name (wrapper prefixes of AC, compile, FSDP1 removed)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def plan_from_patterns(patterns: Mapping[str, Init | Callable[[re.Match], Init]]) -> Callable[[str], Init]:
    """An init plan from ``{regex: Init or fn(match) -> Init}``, the first full match winning."""
    compiled = [(re.compile(k), v) for k, v in patterns.items()]

    def plan(fqn: str) -> Init:
        for rx, v in compiled:
            m = rx.fullmatch(fqn)
            if m:
                return v(m) if callable(v) else v
        raise InitPlanError(f"init: no distribution for parameter '{fqn}'; add a pattern for it to the init plan")

    return plan


@torch.no_grad()
def init_parameters(
    module: nn.Module, plan: Callable[[str], Init] | Mapping[str, Init], seed: int, prefix: str = ""
) -> None:
    """Fill every parameter of ``module`` (plain or DTensor, each rank its own shard) from ``plan`` and ``seed``.

    ``plan``: ``fqn -> Init`` or a ``{regex: Init}`` mapping (:func:`plan_from_patterns`); FQNs are the plain
    model's (wrapper prefixes removed), with ``prefix`` prepended. Parameters shared under several names are
    filled once. Every parameter without a distribution is named, all in one error, before anything is written.
    """
    if isinstance(plan, Mapping):
        plan = plan_from_patterns(plan)
    params = [(prefix + canonical_fqn(n), p) for n, p in module.named_parameters()]
    inits, missing = [], []
    for fqn, _ in params:
        try:
            inits.append(plan(fqn))
        except (InitPlanError, KeyError):
            missing.append(fqn)
    if missing:
        raise InitPlanError(
            f"init: no distribution for {len(missing)} parameter(s): {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; add them to the model's init plan"
        )
    from torch.distributed.tensor import DTensor

    for (fqn, p), init in zip(params, inits):
        if p.is_meta:
            raise ValueError(
                f"init: parameter '{fqn}' is on the meta device; allocate it first "
                "(titanlike.parallel.to_empty_keeping_ties)"
            )
        local = p.to_local() if isinstance(p, DTensor) else p.data  # under no_grad: the local tensor itself
        if local.numel() == 0:
            continue
        generate(init, seed, init.key or fqn, p.shape, local_indices(p), out=local)
