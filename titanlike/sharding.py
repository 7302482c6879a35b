"""The sharding vocabulary: how a model's modules split over tensor parallelism, declared once, as plain data.

A model declares in ``titanlike/models/<name>/sharding.py`` one entry per module pattern (``parallelize_module``
patterns: module FQNs whose atoms may be ``*``, which matches one atom)::

    SHARDING = {
        "tok_embeddings": VocabEmbedding(),
        "layers.*.attention_norm": Norm(),
        "layers.*.attention": Region(),
        "layers.*.attention.wq": Colwise(),
        ...
        "layers.*.attention.wo": Rowwise(),
        "norm": Norm(),
        "output": Head(),
    }

This module imports nothing of titanlike and nothing of ``torch.distributed``: the models import it. Everything
else is derived from the same entries, so no plan is written twice:

* the one translator into torch (or torchao float8) ``ParallelStyle`` s, ``titanlike.parallel.tensor_parallel``
  (``tp_plan``): ``seq`` below is the residual stream's layout between the blocks, ``Shard(1)`` (the sequence)
  under sequence parallelism, else ``Replicate()``;
* every parameter's tensor-parallel dim and FSDP dim for the planner (:func:`param_dims`);
* which ``nn.Linear`` s may train in float8 (:func:`float8_patterns`), and hence whether a model can train in float8
  at all (``titanlike.layout.rules``);
* which parameters Muon orthogonalizes, and as which matrices (:meth:`Entry.matrices`: a fused projection's chunks
  one by one, a stacked expert weight expert by expert), for ``optimizer.name = "Muon"``
  (``titanlike.parallel.muon``); every other parameter trains with AdamW.

Extension points (docs/adding_a_model.md): an expert-parallel entry (experts' weights split over an ``ep`` mesh
axis) is one more :class:`Entry` subclass here, one case in the translator and its :meth:`Entry.tp_dim`; entries
derived from a transformers model's ``base_model_tp_plan`` map its strings one to one (``colwise`` -> Colwise,
``rowwise`` -> Rowwise, an embedding's ``rowwise`` -> VocabEmbedding, ``sequence_parallel`` -> Norm, ...); an
optimizer that treats matrices apart (Muon) reads which parameters are matrices and where a fused projection's
chunks lie from the entries (:func:`entry_for`, :attr:`FusedColwise.chunks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch

__all__ = [
    "Colwise",
    "Entry",
    "FusedColwise",
    "Head",
    "HeadNorm",
    "HeadParams",
    "Latent",
    "Matrices",
    "Norm",
    "PositionTable",
    "Region",
    "Rowwise",
    "TokenLocal",
    "VocabEmbedding",
    "check_sharding",
    "entry_for",
    "float8_patterns",
    "local_tensor",
    "matches",
    "muon_patterns",
    "param_dims",
    "stacked_matrices",
    "whole_matrix",
]

# The matrices an orthogonalizing optimizer (Muon) sees in one parameter: one box of index ranges
# ``((start, stop) per dim)`` each; a box's leading dims (all but the last two) span one index (a stacked expert),
# its last two are the matrix's rows and columns.
Box = tuple[tuple[int, int], ...]
Matrices = tuple[Box, ...]


def whole_matrix(shape: tuple[int, ...]) -> Matrices:
    """A 2-D parameter as one matrix."""
    return (tuple((0, n) for n in shape),)


def row_chunks(shape: tuple[int, ...], sizes: list[int]) -> Matrices:
    """A 2-D parameter whose rows are consecutive chunks of ``sizes`` (a fused q|k|v, gate|up): one matrix each."""
    out, start = [], 0
    for n in sizes:
        out.append(((start, start + n), (0, shape[1])))
        start += n
    return tuple(out)


def stacked_matrices(shape: tuple[int, ...]) -> Matrices:
    """A stacked weight ``(n, rows, cols)`` (mixture-of-experts: one ``rows x cols`` matrix per expert): each
    matrix on its own."""
    n, rows, cols = shape
    return tuple(((e, e + 1), (0, rows), (0, cols)) for e in range(n))


@dataclass(frozen=True)
class Entry:
    """How one module's parameters split over tensor parallelism. ``float8``: an ``nn.Linear`` that may train in
    float8 (torchao ``Float8Linear``, with torchao's float8 tensor-parallel styles under tensorwise scaling); a
    keyword argument of every entry."""

    float8: bool = field(default=False, kw_only=True)

    def tp_dim(self, leaf: str, ndim: int, *, tp: int, fsdp: bool) -> int | None:
        """The dim tensor parallelism shards this module's parameter ``leaf`` on (``ndim`` dims), None when it is
        replicated over tp. ``tp``: the degree; ``fsdp``: FSDP shards the parameter too."""
        return None

    def fsdp_dim(self, leaf: str, ndim: int, *, tp: int) -> int:
        """The dim FSDP shards the (tp-local) parameter on."""
        return 0

    def matrices(self, leaf: str, shape: tuple[int, ...]) -> Matrices | None:
        """The matrices Muon orthogonalizes in this module's parameter ``leaf`` of (full) ``shape``, one by one; None:
        the parameter trains with AdamW (embeddings, head, norms, biases, and the matrices of an entry with
        ``muon=False``)."""
        return None


def _weight_matrix(entry, leaf: str, shape: tuple[int, ...]) -> Matrices | None:
    """A Linear entry's weight as one matrix, unless the model keeps it on AdamW (``muon=False``)."""
    return whole_matrix(shape) if entry.muon and leaf == "weight" and len(shape) == 2 else None


@dataclass(frozen=True)
class Colwise(Entry):
    """An ``nn.Linear`` whose output features split over tp (weight and bias dim 0): from the replicated input each
    rank computes its own heads / hidden units, a local output (torch's ``ColwiseParallel``). ``muon``: its weight
    is one of the matrices Muon orthogonalizes (False: AdamW)."""

    float8: bool = field(default=True, kw_only=True)
    muon: bool = field(default=True, kw_only=True)

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        return 0

    def matrices(self, leaf, shape):
        return _weight_matrix(self, leaf, shape)


@dataclass(frozen=True)
class Rowwise(Entry):
    """An ``nn.Linear`` whose input features split over tp (weight dim 1): the ranks' partial outputs are summed into
    the residual stream's layout (Megatron's g: an all-reduce, a reduce-scatter under SP); the bias is replicated
    and added once, after the sum (torch's ``RowwiseParallel`` to ``seq``). ``muon``: as for :class:`Colwise`."""

    float8: bool = field(default=True, kw_only=True)
    muon: bool = field(default=True, kw_only=True)

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        return 1 if leaf == "weight" else None

    def matrices(self, leaf, shape):
        return _weight_matrix(self, leaf, shape)


@dataclass(frozen=True)
class FusedColwise(Entry):
    """An ``nn.Linear`` whose output is a concatenation of chunks (q | k | v, gate | up), each split over tp: every
    rank holds its slice of every chunk (``titanlike.parallel.fused.FusedColwiseParallel``). ``chunks``: the number
    of equal chunks, or their sizes in proportion (``(n_heads, n_kv_heads, n_kv_heads)`` for grouped-query q|k|v;
    scaled to the Linear's output features). ``head_dim``: also require whole heads per rank.

    Equal chunks: the weight ``_StridedShard`` on dim 0 (FSDP then shards dim 1), the bias too, or replicated over
    tp once FSDP shards it. Unequal chunks: weight and bias replicated over tp (each rank cuts its rows in the
    forward; two extra gradient all-reduces per step: docs/parallelism.md).

    Muon orthogonalizes each chunk of the weight as its own matrix (q, k and v; gate and up), exactly as it would
    separate Linears: the fused layout is a kernel choice, not a different model (``muon=False``: AdamW)."""

    chunks: int | tuple[int, ...] = 3
    head_dim: int | None = None
    muon: bool = field(default=True, kw_only=True)

    @property
    def equal(self) -> bool:
        return isinstance(self.chunks, int) or len(set(self.chunks)) == 1

    def sizes(self, out_features: int) -> int | list[int]:
        """``FusedColwiseParallel``'s ``chunks`` argument for a Linear of ``out_features``."""
        if isinstance(self.chunks, int):
            return self.chunks
        total = sum(self.chunks)
        if out_features % total:
            raise ValueError(f"FusedColwise{self.chunks}: {out_features} output features do not split in proportion")
        return [out_features * c // total for c in self.chunks]

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        if not self.equal or (ndim == 1 and fsdp):
            return None
        return 0

    def fsdp_dim(self, leaf, ndim, *, tp):
        return 1 if self.equal and tp > 1 and ndim >= 2 else 0

    def matrices(self, leaf, shape):
        if _weight_matrix(self, leaf, shape) is None:
            return None
        sizes = self.sizes(shape[0])
        return row_chunks(shape, [shape[0] // sizes] * sizes if isinstance(sizes, int) else sizes)


@dataclass(frozen=True)
class Norm(Entry):
    """A norm on the residual stream: weights (and bias) replicated over tp; under sequence parallelism it runs on
    this rank's part of the sequence (its weight gradients summed over tp), else on the replicated stream."""


@dataclass(frozen=True)
class HeadNorm(Entry):
    """A norm over each rank's own heads (a per-head RMSNorm of q and k, QK-norm): its weight is replicated over tp,
    but every rank normalises different heads, so its gradient covers only them and is summed over tp (a
    ``Partial`` gradient: one all-reduce of the weight's gradient per step). Not a residual-stream norm: sequence
    parallelism does not apply (attention runs on the gathered sequence). ``heads_dim``: the dim of its input
    that holds the heads ((batch, seq, heads, head_dim): 2)."""

    heads_dim: int = 2


@dataclass(frozen=True)
class HeadParams(Entry):
    """A module whose parameters hold one slice per attention head along their dim 0, split over tp with the heads
    the region's Colwise projections give each rank (``Shard(0)``, as a Colwise weight), running on this rank's heads:
    its tensor inputs are local shards along ``heads_dim`` (the heads / channels dim: (batch, seq, heads): 2), its
    outputs local tensors. gpt-oss's attention sinks (``weight`` (heads,), called with no input, returning this
    rank's heads' values); a linear-attention layer's per-head decay parameters and its short conv's channels."""

    heads_dim: int = 2

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        return 0


@dataclass(frozen=True)
class Latent(Entry):
    """A module inside a ``Region`` that runs on the replicated input for every head, before the heads split (MLA's
    latent down-projections ``wq_a`` / ``wkv_a`` and their norms): its parameters are replicated over tp, and since
    each rank's heads use the whole output, their gradient covers only those heads and is summed over tp (a
    ``Partial`` gradient, as ``HeadNorm``'s). Its input and output stay replicated DTensors, so the column-wise
    projection after it splits the heads; ``local_output``: hand its output on as this rank's local tensor instead
    (its gradient a partial sum over tp), for a tensor joined to per-head ones (MLA's shared RoPE key)."""

    local_output: bool = False


@dataclass(frozen=True)
class VocabEmbedding(Entry):
    """The token table, split over tp by vocabulary rows (dim 0); its output takes the residual stream's layout
    (an all-reduce of the partial lookups, a reduce-scatter under SP)."""

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        return 0


@dataclass(frozen=True)
class PositionTable(Entry):
    """A learned position table, replicated over tp, whose output joins the residual stream's layout (under sequence
    parallelism this rank's sequence rows: no forward communication, one all-gather of its gradient)."""


@dataclass(frozen=True)
class Head(Entry):
    """The output head: weight split over tp by vocabulary rows (dim 0), fed from the stream's layout (all-gathered
    under SP); the logits stay vocab-sharded for the vocab-parallel loss, or are gathered without it."""

    def tp_dim(self, leaf, ndim, *, tp, fsdp):
        return 0


@dataclass(frozen=True)
class Region(Entry):
    """A module whose body runs tensor-parallel (attention, the MLP), between Colwise and Rowwise projections: its
    first positional input, the residual stream, enters replicated (Megatron's f: identity forward, all-reduce
    backward; an all-gather forward and a reduce-scatter backward under SP). Keyword arguments (per-batch context:
    the RoPE rows) pass untouched. No parameters of its own. ``keyword``: the stream enters as this keyword argument
    instead (transformers' decoder layers call ``self_attn(hidden_states=...)``); the positional inputs then pass
    untouched."""

    keyword: str | None = None


@dataclass(frozen=True)
class TokenLocal(Entry):
    """A module that runs on this rank's own tokens and returns them, under sequence parallelism: an MoE block, whose
    router routes each tp rank's part of the sequence like a data-parallel rank's (the experts split over ``ep``,
    which borrows the tp ranks). Its input is the local shard of the stream (no all-gather), its output re-enters the
    stream as that shard; its parameters are not split over tp but data-parallel over it (each tp rank saw other
    tokens): they are FSDP-sharded over dp x cp x tp with their gradients summed (``titanlike.parallel
    .parallelize``). Without sequence parallelism (every tp rank holding every token) it has no style."""


# ------------------------------------------------------------------------------------------------- lookups
def matches(pattern: str, fqn: str) -> bool:
    """Whether module FQN ``fqn`` matches ``pattern`` atom by atom (``*`` matches one atom), as
    ``parallelize_module`` reads plan keys."""
    atoms, parts = pattern.split("."), fqn.split(".") if fqn else []
    return len(atoms) == len(parts) and all(fnmatch(p, a) for p, a in zip(parts, atoms))


def entry_for(sharding: Mapping[str, Entry], module_fqn: str) -> Entry | None:
    """The entry of module ``module_fqn`` (the first pattern that matches it), or None."""
    for pattern, entry in sharding.items():
        if matches(pattern, module_fqn):
            return entry
    return None


def param_dims(sharding: Mapping[str, Entry], fqn: str, ndim: int, *, tp: int, fsdp: bool) -> tuple[int | None, int]:
    """(tensor-parallel dim or None, FSDP dim) of parameter ``fqn`` (``ndim`` dims) under ``sharding`` with tp degree
    ``tp`` (1: no tensor parallelism), FSDP on or off: as the translator's styles and ``apply_fsdp`` shard it.
    A parameter whose module has no entry is replicated over tp."""
    owner, _, leaf = fqn.rpartition(".")
    entry = entry_for(sharding, owner)
    if entry is None:
        return None, 0
    d = entry.tp_dim(leaf, ndim, tp=tp, fsdp=fsdp) if tp > 1 else None
    return d, entry.fsdp_dim(leaf, ndim, tp=tp)


def float8_patterns(sharding: Mapping[str, Entry]) -> tuple[str, ...]:
    """The module patterns whose ``nn.Linear`` s may train in float8 (entries with ``float8=True``)."""
    return tuple(p for p, e in sharding.items() if e.float8)


def muon_patterns(sharding: Mapping[str, Entry]) -> tuple[str, ...]:
    """The module patterns whose entries give Muon matrices (Linear entries with ``muon=True``)."""
    return tuple(p for p, e in sharding.items() if getattr(e, "muon", False))


def check_sharding(sharding: Mapping[str, Entry], module_fqns: Iterable[str]) -> list[str]:
    """Problems of a declaration against a model's module FQNs: a pattern matching no module, a module matched by
    two patterns (one line each)."""
    fqns = list(module_fqns)
    out = []
    for pattern in sharding:
        if not any(matches(pattern, f) for f in fqns):
            out.append(f"sharding pattern '{pattern}' matches no module")
    for f in fqns:
        hits = [p for p in sharding if matches(p, f)]
        if len(hits) > 1:
            out.append(f"module '{f}' is matched by {len(hits)} sharding patterns ({', '.join(hits)})")
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a sharded tensor: a DTensor's ``to_local()``, else ``t`` itself.

    In grad mode that is a differentiable view, a new one at each call (an expert weight in the MoE forward);
    under ``torch.no_grad`` it is the DTensor's own local tensor, the same object at every call, for any tensor but
    a parameter (``p.detach()``, optimizer state, buffers): call it there where identity matters (buffers keyed by
    the tensors) or where the shard is written in place. Duck-typed, so that the models, which import nothing of
    torch.distributed, can call it; told apart by the shard it holds (``_local_tensor``): inside a compiled block
    dynamo answers ``hasattr(dtensor, "to_local")`` False (torch 2.13), which would compute with the whole DTensor."""
    return t.to_local() if hasattr(t, "_local_tensor") else t
