"""Muon under every layout: each matrix's update orthogonalized once per step, as the whole matrix, by one rank.

Muon (Keller Jordan; torch.optim.Muon) keeps a momentum buffer per matrix and updates the weight by the
Newton-Schulz orthogonalization of the (Nesterov) momentum. Newton-Schulz is not elementwise: on a shard of a
matrix (an FSDP row block, a tensor-parallel column block, one chunk of a fused q|k|v) it computes a different
update. :class:`Muon` therefore, per step:

1. updates each momentum buffer on the rank's own shard (elementwise, exactly as on one device);
2. gathers each matrix's momentum-updated gradient to one **owner** rank: the ranks of the matrix's mesh (its data
   and tensor-parallel ranks, a pipeline stage's own) own the matrices round-robin (``titanlike.layout.muon``), so
   the Newton-Schulz work is divided, not repeated; one all-to-all per bucket of matrices gathers them all;
3. runs Newton-Schulz on the owner (torch's operations, coefficients and order, in ``ns_dtype``: torch's
   bfloat16 by default);
4. scatters the result back to every rank holding a shard of the matrix (one all-to-all per bucket), where the
   weight decay and the update ``-lr * adjust(shape) * O`` are applied to the local shard.

Which parameters are matrices comes from the model's sharding entries (:func:`muon_matrices`:
``titanlike.sharding.Entry.matrices``): the blocks' Linear weights; embeddings, head, norms, biases and any entry
marked ``muon=False`` train with AdamW (torch's own ``AdamW``, inside this optimizer). A fused projection's chunks
(q, k, v; gate, up) are separate matrices, as separate Linears would be; a stacked expert weight's experts too.

The shards are DTensors of any placement titanlike produces (FSDP's ``Shard(0)`` / ``Shard(1)``, TP's ``Shard``,
the fused projections' ``_StridedShard``, HSDP's and tp-replicated weights' ``Replicate``) or plain tensors (one
device, a pipeline stage without data / tensor parallelism). Each rank's local block of the global tensor is read
off the placements with DTensor's own split (``_split_tensor``) applied to the index range of each dim, so
gathering and scattering are exact copies, and every rank's arithmetic equals one device's: the float64 gate
(tests/parallel/gate.py) checks it to 1e-10, and one device equals ``torch.optim.Muon`` + ``torch.optim.AdamW``.

The momentum buffers are DTensors like their parameters (``state[p]["momentum_buffer"]``, torch's key), so DCP
saves, reshards and resumes them like AdamW's moments.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titanlike.layout.muon import lr_ratio, ns_flops, plan_buckets
from titanlike.models import spec_for
from titanlike.sharding import Box, Matrices, entry_for, local_tensor, whole_matrix

__all__ = ["NS_COEFFICIENTS", "Muon", "MuonStats", "muon_matrices", "newton_schulz"]

# torch.optim.Muon's defaults (Keller Jordan's quintic).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    update: Tensor,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """torch.optim.Muon's orthogonalization of a matrix (``torch.optim._muon._zeropower_via_newtonschulz``: the same
    operations in the same order), computed in ``dtype`` (torch: bfloat16) on a copy; returns a ``dtype`` tensor."""
    if steps >= 100:
        raise ValueError("Newton-Schulz: steps must be below 100")
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalizes a matrix, got a tensor of shape {tuple(update.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"Newton-Schulz takes 3 coefficients (a, b, c), got {len(coefficients)}")
    a, b, c = coefficients
    x = update.to(dtype=dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


# ------------------------------------------------------------------------------------------------- the split
def muon_matrices(model_parts: Sequence[nn.Module], sharding: Mapping | None = None) -> dict[Tensor, Matrices]:
    """The parameters Muon orthogonalizes, each with its matrices, read off the sharding entries of the modules
    (``sharding``: default the registered model's, ``ModelSpec.sharding``; a user's module passes its own
    declaration in the same vocabulary, ``titanlike.sharding``). Parameters whose module has no entry, or whose
    entry gives no matrices, are not in the result (they train with AdamW). Shapes are the full (global) ones."""
    out: dict[Tensor, Matrices] = {}
    for part in model_parts:
        decl = sharding
        if decl is None:
            spec = spec_for(part)
            if spec is None:
                raise ValueError(
                    f"Muon: {type(part).__name__} is not a registered model, so no sharding entries say which of its "
                    f"parameters are matrices; pass sharding= (titanlike.sharding entries) or matrices= to Muon"
                )
            decl = spec.sharding_of(getattr(part, "args", None))
        for module_fqn, module in part.named_modules():
            entry = entry_for(decl, module_fqn)
            if entry is None:
                continue
            for leaf, p in module.named_parameters(recurse=False):
                boxes = entry.matrices(leaf, tuple(p.shape))
                if boxes is not None and p.requires_grad:
                    out[p] = boxes
    return out


# ------------------------------------------------------------------------------------------------- shards
def _local_indices(shape: Sequence[int], mesh_shape: Sequence[int], placements, coord: Sequence[int]) -> list[Tensor]:
    """Per dim, the global indices of the rows / columns the rank at mesh coordinate ``coord`` holds, in its local
    order: DTensor's own split of each dim, placement by placement (``distribute_tensor``'s loop), applied to the
    index range of the dim (a ``Shard(d)`` or ``_StridedShard(d)`` acts on dim ``d`` alone)."""
    idx = [torch.arange(n) for n in shape]
    for i, pl in enumerate(placements):
        if isinstance(pl, _StridedShard):
            one_dim = _StridedShard(0, split_factor=pl.split_factor)
        elif isinstance(pl, Shard):
            one_dim = Shard(0)
        elif isinstance(pl, Replicate):
            continue
        else:
            raise ValueError(f"Muon: a parameter with placement {pl} (a Partial parameter?) cannot be orthogonalized")
        d = pl.dim % len(shape)
        pieces, _ = one_dim._split_tensor(idx[d], mesh_shape[i], with_padding=False)
        idx[d] = pieces[coord[i]]
    return idx


Run = tuple[int, int, int]  # (offset in the rank's block, offset in the matrix, length)


@dataclass(frozen=True)
class _Piece:
    """One rank's part of one matrix: the block of its local tensor (``(start, stop)`` per dim) and where that
    block's rows / columns lie in the matrix (runs of consecutive indices per dim)."""

    block: tuple[tuple[int, int], ...]
    runs: tuple[tuple[Run, ...], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.block)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _piece(idx: list[Tensor], box: Box) -> _Piece:
    block, runs = [], []
    for v, (lo, hi) in zip(idx, box):
        # A rank's indices increase along each dim (Shard and _StridedShard keep the order), so the ones inside the
        # box are one contiguous block of the local tensor.
        s, e = int(torch.searchsorted(v, lo)), int(torch.searchsorted(v, hi))
        block.append((s, e))
        g = v[s:e] - lo
        starts = [0, *(torch.nonzero(g.diff() != 1).flatten() + 1).tolist()] if len(g) else []
        ends = [*starts[1:], len(g)]
        runs.append(tuple((a, int(g[a]), b - a) for a, b in zip(starts, ends)))
    return _Piece(tuple(block), tuple(runs))


def _narrow(t: Tensor, spans) -> Tensor:
    for d, (start, length) in enumerate(spans):
        t = t.narrow(d, start, length)
    return t


def _put(matrix: Tensor, block: Tensor, piece: _Piece) -> None:
    """Copy a rank's ``block`` into its places in the (box-shaped) ``matrix``."""
    for combo in itertools.product(*piece.runs):
        _narrow(matrix, [(m, n) for _, m, n in combo]).copy_(_narrow(block, [(b, n) for b, _, n in combo]))


def _take(matrix: Tensor, piece: _Piece) -> Tensor:
    """The rank's block of the (box-shaped) ``matrix``."""
    out = matrix.new_empty(piece.shape)
    for combo in itertools.product(*piece.runs):
        _narrow(out, [(b, n) for b, _, n in combo]).copy_(_narrow(matrix, [(m, n) for _, m, n in combo]))
    return out


@dataclass
class _Matrix:
    """One matrix (a box of one parameter) and how it is spread over the ranks of its group."""

    param: Tensor
    box: Box
    rows: int
    cols: int
    group_index: int  # its param group (an index: load_state_dict replaces the group dicts)
    mine: _Piece | None = None  # this rank's block
    pieces: list[_Piece] | None = None  # every group rank's block, on the owner only
    replica_of: list[int] | None = None  # group rank -> the index of its replica set (ranks with equal shards)

    def sources(self, owner: int) -> list[int]:
        """The group ranks whose blocks make up the matrix for ``owner``: its own replica set."""
        return [r for r, s in enumerate(self.replica_of) if s == self.replica_of[owner]]


@dataclass
class _Group:
    """The matrices of one mesh (one process group over its ranks), in the optimizer's order, and their buckets."""

    group: object  # a ProcessGroup, or None: parameters local to this rank
    size: int
    rank: int
    matrices: list[_Matrix] = field(default_factory=list)
    buckets: list = field(default_factory=list)


@dataclass
class MuonStats:
    """What the last :meth:`Muon.step` did on this rank (the planner predicts the same numbers)."""

    matrices: int = 0  # matrices this rank orthogonalized
    ns_flops: int = 0  # their Newton-Schulz FLOPs
    collectives: int = 0  # all-to-alls issued
    sent: int = 0  # elements sent to other ranks (gather + scatter)
    received: int = 0  # elements received from other ranks


def _mesh_key(mesh) -> tuple:
    return (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist()))


def _flattened_groups(params: Sequence[Tensor]) -> dict[tuple, object]:
    """The process group over all ranks of each DTensor parameter's mesh (its flattened mesh; a 1-D mesh's own).
    Collective over the world: every rank flattens the same meshes in the same order (a pipeline stage whose
    matrices live elsewhere still takes part, through its other parameters' meshes), or gets a one-line error
    instead of a hang."""
    meshes: dict[tuple, object] = {}
    for p in params:
        if isinstance(p, DTensor):
            meshes.setdefault(tuple(p.device_mesh.mesh_dim_names or ()), p.device_mesh)
    names = sorted(n for n, m in meshes.items() if m.ndim > 1)
    if meshes and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, names)
        names = sorted(set().union(*map(set, everyone)))
        lacking = [n for n in names if n not in meshes]
        if lacking:
            raise RuntimeError(
                f"Muon: rank {dist.get_rank()} holds no parameter on the mesh {lacking[0]} other ranks' "
                f"parameters live on; build the optimizer over every model part of every rank"
            )
    flat = {n: meshes[n]._flatten() for n in names}  # in the same order on every rank (collective)
    return {_mesh_key(m): (flat[n] if n in flat else m).get_group() for n, m in meshes.items()}


class _ParamLayout:
    """Where a DTensor parameter's shards live in its group: every group rank's mesh coordinate, its replica set,
    and (on demand) its global indices per dim."""

    def __init__(self, param: DTensor, group):
        mesh, self.param = param.device_mesh, param
        grid = mesh.mesh
        position = {r: i for i, r in enumerate(grid.flatten().tolist())}
        self.shape = tuple(grid.shape)
        self.coords = [_unravel(position[r], self.shape) for r in dist.get_process_group_ranks(group)]
        self.me = dist.get_group_rank(group, dist.get_rank())
        replicated = [i for i, pl in enumerate(param.placements) if isinstance(pl, Replicate)]
        ids: dict[tuple, int] = {}
        self.replica_of = [ids.setdefault(tuple(c[i] for i in replicated), len(ids)) for c in self.coords]
        self._indices: dict[int, list[Tensor]] = {}
        local, mine = tuple(param.to_local().shape), tuple(len(v) for v in self.indices(self.me))
        if mine != local:
            raise RuntimeError(
                f"Muon: the local shard {local} of a {tuple(param.shape)} parameter with placements "
                f"{param.placements} is not DTensor's split of it {mine}; this layout cannot be orthogonalized"
            )

    def indices(self, rank: int) -> list[Tensor]:
        if rank not in self._indices:
            self._indices[rank] = _local_indices(self.param.shape, self.shape, self.param.placements, self.coords[rank])
        return self._indices[rank]


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))


def _matrix_shape(param: Tensor, box: Box) -> tuple[int, int]:
    lead = [hi - lo for lo, hi in box[:-2]]
    if len(box) != param.ndim or len(box) < 2 or any(n != 1 for n in lead):
        raise ValueError(
            f"Muon: matrix box {box} of a {tuple(param.shape)} parameter must give every dim a range, the leading "
            f"ones (stacked experts) one index each"
        )
    return box[-2][1] - box[-2][0], box[-1][1] - box[-1][0]


# ------------------------------------------------------------------------------------------------- the optimizer
class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update for the matrices, distributed as the module docstring says, and torch.optim.AdamW
    for every other parameter, in one optimizer (one ``state``, one list of ``param_groups``, so LR schedules and
    DCP checkpoints treat it like AdamW).

    ``params``: the matrix parameters (tensors, or groups of them as dicts); ``matrices``: each one's matrices
    (:func:`muon_matrices`; default: a 2-D parameter as one matrix). ``adamw_params``: the others (tensors or
    groups). Hyper-parameters as torch.optim.Muon names them (``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``: ``"original"`` or ``"match_rms_adamw"``);
    ``ns_dtype``: the Newton-Schulz precision (torch's bfloat16); ``bucket_mb``: full-matrix megabytes (in
    ``ns_dtype``) per pair of all-to-alls. The AdamW group's ``adamw_lr`` / ``adamw_weight_decay`` default to
    ``lr`` / ``weight_decay``; ``adamw_kwargs`` go to ``torch.optim.AdamW`` (betas, eps, foreach, fused).

    Collective: every rank holding a shard of a matrix must construct it and call :meth:`step` together (it
    flattens each multi-dim mesh once, on every rank of the world).
    """

    def __init__(
        self,
        params: Iterable,
        *,
        matrices: Mapping[Tensor, Matrices] | None = None,
        adamw_params: Iterable = (),
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        bucket_mb: float = 128.0,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        adamw_kwargs: Mapping | None = None,
    ):
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError(f"Muon: lr, weight_decay and momentum must be >= 0, got {lr}, {weight_decay}, {momentum}")
        adjust_lr_fn = adjust_lr_fn or "original"
        lr_ratio(adjust_lr_fn, 1, 1)  # validates the name
        if len(ns_coefficients) != 3 or ns_steps >= 100 or ns_steps < 1:
            raise ValueError(f"Muon: 3 coefficients and 1 <= ns_steps < 100, got {ns_coefficients}, {ns_steps}")
        muon_defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(float(c) for c in ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        muon_groups = _groups(params, {**muon_defaults, "algorithm": "muon"})
        adamw_groups = _groups(adamw_params, {"algorithm": "adamw"})
        adamw_lr = lr if adamw_lr is None else adamw_lr
        adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        # torch's AdamW on the same group dicts and the same state dict (relinked after load_state_dict)
        self._adamw = (
            torch.optim.AdamW(adamw_groups, lr=adamw_lr, weight_decay=adamw_wd, **dict(adamw_kwargs or {}))
            if adamw_groups
            else None
        )
        super().__init__(muon_groups + adamw_groups, {})
        if self._adamw is not None:
            self._adamw.state = self.state
        for g in muon_groups:
            for p in g["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon: a {p.ndim}-D parameter of shape {tuple(p.shape)} is not a matrix")
        given = dict(matrices) if matrices is not None else {}
        self._matrices = {p: given.get(p) or whole_matrix(tuple(p.shape)) for g in muon_groups for p in g["params"]}
        self.ns_dtype = ns_dtype
        self.bucket_bytes = bucket_mb * 2**20
        self.stats = MuonStats()
        self._plan: list[_Group] | None = None
        self._group_index = {
            p: i for i, g in enumerate(self.param_groups) if g["algorithm"] == "muon" for p in g["params"]
        }
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._groups_by_mesh = _flattened_groups(all_params)

    # ------------------------------------------------------------------------------------------ state
    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        adamw = self.__dict__.get("_adamw")
        if adamw is not None:  # load_state_dict replaced state and param_groups: torch's AdamW shares them again
            adamw.__setstate__(
                {"state": self.state, "param_groups": [g for g in self.param_groups if g["algorithm"] == "adamw"]}
            )

    # ------------------------------------------------------------------------------------------ the plan
    def _build_plan(self) -> list[_Group]:
        """Every matrix of every Muon group, grouped by mesh, with its owners and buckets, this rank's block of each
        and, for the matrices it owns, every rank's (built on the first step, then kept: the layout does not
        change)."""
        groups: dict[object, _Group] = {}
        for i, g in enumerate(self.param_groups):
            if g["algorithm"] != "muon":
                continue
            for p in g["params"]:
                group = self._groups_by_mesh[_mesh_key(p.device_mesh)] if isinstance(p, DTensor) else None
                if group not in groups:
                    size = 1 if group is None else dist.get_world_size(group)
                    groups[group] = _Group(group, size, 0 if group is None else dist.get_rank(group))
                groups[group].matrices += [_Matrix(p, box, *_matrix_shape(p, box), i) for box in self._matrices[p]]
        itemsize = torch.empty((), dtype=self.ns_dtype).element_size()
        for gr in groups.values():
            gr.buckets = plan_buckets([m.rows * m.cols * itemsize for m in gr.matrices], gr.size, self.bucket_bytes)
            owner = {k: o for b in gr.buckets for k, o in zip(b.items, b.owners)}
            layouts: dict[int, _ParamLayout] = {}
            for k, m in enumerate(gr.matrices):
                if gr.group is None:
                    m.mine = _piece([torch.arange(n) for n in m.param.shape], m.box)
                    continue
                lay = layouts.get(id(m.param))
                if lay is None:
                    lay = layouts[id(m.param)] = _ParamLayout(m.param, gr.group)
                m.mine, m.replica_of = _piece(lay.indices(lay.me), m.box), lay.replica_of
                if owner[k] == gr.rank:
                    m.pieces = [_piece(lay.indices(r), m.box) for r in range(gr.size)]
        return list(groups.values())

    # ------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        updates: dict[Tensor, Tensor] = {}  # param -> its momentum-updated gradient, local shard
        for g in self.param_groups:
            if g["algorithm"] != "muon":
                continue
            for p in g["params"]:
                if p.grad is None:
                    if isinstance(p, DTensor):
                        raise RuntimeError(
                            f"Muon: a {tuple(p.shape)} matrix has no gradient on rank {dist.get_rank()}; every "
                            f"rank holding a shard must have one (its peers wait for it in the same all-to-all)"
                        )
                    continue
                if isinstance(p, DTensor) and p.grad.placements != p.placements:
                    raise RuntimeError(
                        f"Muon: a gradient with placements {p.grad.placements} on a parameter with placements "
                        f"{p.placements}; reduce it first (apply_tp / apply_fsdp give gradients their parameter's)"
                    )
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                grad, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
                buf.lerp_(grad, 1 - g["momentum"])
                updates[p] = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        if self._plan is None:
            self._plan = self._build_plan()
        self.stats = MuonStats()
        results: list[tuple[_Matrix, Tensor]] = []  # (matrix, this rank's block of its orthogonalized update)
        for gr in self._plan:
            mats = [m for m in gr.matrices if m.param in updates]
            if gr.group is None:
                results += _orthogonalize_local(mats, updates, self)
                continue
            if len(mats) != len(gr.matrices):
                raise RuntimeError("Muon: some matrices of a distributed group have no gradient")
            for bucket in gr.buckets:
                results += _orthogonalize_bucket(gr, bucket, updates, self)
        _apply(results, [p for p in updates], self)
        return loss

    def _ns(self, matrix: Tensor, m: _Matrix) -> Tensor:
        """Newton-Schulz on matrix ``m`` (its ``rows x cols`` values), with its group's hyper-parameters."""
        g = self.param_groups[m.group_index]
        self.stats.matrices += 1
        self.stats.ns_flops += ns_flops(matrix.shape[0], matrix.shape[1], g["ns_steps"])
        return newton_schulz(matrix, g["ns_coefficients"], g["ns_steps"], g["eps"], self.ns_dtype)

    def describe(self) -> str:
        """One line: how many tensors each algorithm trains."""
        mats = [p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        rest = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        n_mats = sum(len(self._matrices[p]) for p in mats)
        return (
            f"Muon on {len(mats)} tensors ({n_mats} matrices, {sum(p.numel() for p in mats) / 1e6:,.2f}M elements), "
            f"AdamW on {len(rest)} ({sum(p.numel() for p in rest) / 1e6:,.2f}M elements)"
        )


def _groups(params: Iterable, extra: dict) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**extra, **g, "params": list(g["params"])} for g in params]
    return [{**extra, "params": params}] if params else []


def _orthogonalize_local(mats: list[_Matrix], updates: dict[Tensor, Tensor], opt: Muon) -> list[tuple[_Matrix, Tensor]]:
    """Matrices whose parameter this rank holds whole: Newton-Schulz here, no communication."""
    out = []
    for m in mats:
        box = _narrow(updates[m.param], [(s, e - s) for s, e in m.mine.block])
        out.append((m, opt._ns(box.reshape(m.rows, m.cols), m).reshape(m.mine.shape)))
    return out


def _orthogonalize_bucket(gr: _Group, bucket, updates: dict[Tensor, Tensor], opt: Muon) -> list[tuple[_Matrix, Tensor]]:
    """One bucket of a mesh's matrices: an all-to-all gathers each matrix's blocks to its owner, the owner runs
    Newton-Schulz, an all-to-all scatters every rank's block of the result back."""
    dtype, me, W = opt.ns_dtype, gr.rank, gr.size
    items = [(gr.matrices[k], owner) for k, owner in zip(bucket.items, bucket.owners)]
    # ---- gather: rank r sends the owner of each matrix its block (if it is in the owner's replica set)
    send = [[] for _ in range(W)]
    recv_sizes = [0] * W
    for m, owner in items:
        if me in m.sources(owner):
            send[owner].append(_narrow(updates[m.param], [(s, e - s) for s, e in m.mine.block]).to(dtype).reshape(-1))
        if owner == me:
            for r in m.sources(owner):
                recv_sizes[r] += m.pieces[r].numel
    recv = _all_to_all(send, recv_sizes, dtype, gr, opt)
    # ---- the owner's matrices, orthogonalized
    offsets = [0] * W
    results = {}
    for k, (m, owner) in enumerate(items):
        if owner != me:
            continue
        box_shape = tuple(hi - lo for lo, hi in m.box)
        full = torch.empty(box_shape, dtype=dtype, device=recv[0].device)
        for r in m.sources(owner):
            n = m.pieces[r].numel
            _put(full, recv[r][offsets[r] : offsets[r] + n].view(m.pieces[r].shape), m.pieces[r])
            offsets[r] += n
        results[k] = opt._ns(full.view(m.rows, m.cols), m).reshape(box_shape)
    # ---- scatter: the owner sends every rank of the mesh its block of the result
    send = [[] for _ in range(W)]
    recv_sizes = [0] * W
    for k, (m, owner) in enumerate(items):
        if owner == me:
            for r in range(W):
                send[r].append(_take(results[k], m.pieces[r]).reshape(-1))
        recv_sizes[owner] += m.mine.numel
    recv = _all_to_all(send, recv_sizes, dtype, gr, opt)
    offsets = [0] * W
    out = []
    for m, owner in items:
        n = m.mine.numel
        out.append((m, recv[owner][offsets[owner] : offsets[owner] + n].view(m.mine.shape)))
        offsets[owner] += n
    return out


def _all_to_all(send: list[list[Tensor]], recv_sizes: list[int], dtype, gr: _Group, opt: Muon) -> list[Tensor]:
    """One all-to-all over the group: ``send[r]`` (flat tensors, concatenated) to rank ``r``; returns what came
    from each rank."""
    device = next((t.device for ts in send for t in ts), None) or _device(opt)
    chunks = [torch.cat(ts) if ts else torch.empty(0, dtype=dtype, device=device) for ts in send]
    sizes = [c.numel() for c in chunks]
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, torch.cat(chunks), recv_sizes, sizes, group=gr.group)
    opt.stats.collectives += 1
    opt.stats.sent += sum(sizes) - sizes[gr.rank]
    opt.stats.received += sum(recv_sizes) - recv_sizes[gr.rank]
    return list(out.split(recv_sizes))


def _device(opt: Muon) -> torch.device:
    return next(p.device for g in opt.param_groups for p in g["params"])


def _apply(results: list[tuple[_Matrix, Tensor]], params: list[Tensor], opt: Muon) -> None:
    """Decoupled weight decay on every updated matrix, then ``-lr * adjust(shape) * O`` on each block (torch's
    ``param.mul_(1 - lr * wd)``, ``param.add_(O, alpha=-adjusted_lr)``, on the local shard)."""
    for p in params:
        g = opt.param_groups[opt._group_index[p]]
        local_tensor(p).mul_(1 - g["lr"] * g["weight_decay"])
    for m, block in results:
        g = opt.param_groups[m.group_index]
        alpha = -g["lr"] * lr_ratio(g["adjust_lr_fn"], m.rows, m.cols)
        _narrow(local_tensor(m.param), [(s, e - s) for s, e in m.mine.block]).add_(block, alpha=alpha)
