"""The cut of a reference tensor that one rank's tensor holds.

A rank's tensor at a point (a module's output, an input gradient, a parameter) is compared with the same point of
the one-device run, cut the way this rank holds it:

* **data**: the rows of this call's micro-batch (the data-parallel rank's rows, split into the step's micro-batches:
  gradient accumulation times pipeline microbatches) and, under context parallelism, the load-balanced sequence
  chunks (:func:`titanlike.parallel.context_parallel.cp_shard`: chunks ``r`` and ``2 cp - 1 - r``); a tensor of the
  batch's tokens flattened along dim 0 (``rows x seq``, as a router sees them): those rows' chunks' tokens;
* **model-parallel**: a DTensor by its own placements (``Shard``, ``_StridedShard``, ``Replicate``: the reference cut
  as ``distribute_tensor`` cuts, a local split, no communication); a plain local tensor narrower than the reference
  along its last dim by the placement of the module's weight along the matching dim (a column-wise Linear's output,
  a row-wise Linear's input, fused q|k|v chunks included), along another dim by a contiguous chunk at this rank's
  coordinate on the model-parallel mesh dim of that size (a sequence-parallel shard).

A tensor whose shape no such cut explains (an expert's permuted tokens) is not compared; the report counts those.
Neither is the input gradient of a tensor every data rank holds whole while the batch is split (a sink passed as an
input, a latent gathered over the cp ranks): each rank holds its partial sum, reduced with the parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["DataCut", "Cut", "describe_placement", "cut_for", "max_diff"]

PENDING = "pending"  # a Partial DTensor: a reduction still owed, compared where it is used


@dataclass
class DataCut:
    """Which rows and sequence positions of the global batch a call on this rank holds."""

    global_rows: int  # rows of the reference's (global) batch
    rows_of: Callable[[int], slice]  # micro-batch index of the step on this rank -> its global rows
    seq_len: int = 0  # the global sequence length (0: no sequence cut)
    cp: int = 1
    cp_rank: int = 0
    # model-parallel mesh dims (not data-parallel): name -> (size, this rank's coordinate)
    model_dims: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Cut:
    """How to cut a reference tensor for one point (rows, sequence, model-parallel), decided from the local tensor."""

    rows: slice | None
    seq_dim: int | None
    cp: int
    cp_rank: int
    last: torch.Tensor | None = None  # index into the reference's last dim (a weight-derived cut)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (dim, parts, index) contiguous chunks
    dtensor: tuple | None = None  # (mesh, placements) of a DTensor
    tokens: tuple[int, int] | None = None  # (rows, seq_len): dim 0 is the batch's tokens flattened (rows x sequence)

    def apply(self, ref: torch.Tensor) -> torch.Tensor:
        r = ref.detach()
        if self.tokens is not None:
            return self._tokens(r)
        if self.rows is not None:
            r = r[self.rows]
        if self.seq_dim is not None:
            from titanlike.parallel.context_parallel import cp_shard

            r = cp_shard(r, self.cp, self.cp_rank, dim=self.seq_dim)
        if self.dtensor is not None:
            mesh, placements = self.dtensor
            return distribute_tensor(r.contiguous(), mesh, placements, src_data_rank=None).to_local()
        if self.last is not None:
            r = r.index_select(r.dim() - 1, self.last)
        for dim, parts, index in self.chunks:
            r = r.chunk(parts, dim=dim)[index]
        return r

    def model_parallel(self) -> bool:
        """Cut along a model-parallel dim (a weight-derived or contiguous chunk, a DTensor shard)."""
        if self.dtensor is not None:
            return any(isinstance(p, (Shard, _StridedShard)) for p in self.dtensor[1])
        return self.last is not None or bool(self.chunks)

    def whole_on_data_ranks(self, data: DataCut, micro: int) -> bool:
        """The batch is split (rows, micro-batches, sequence chunks) but this tensor is not: every data rank holds
        all of it."""
        want = data.rows_of(micro)
        split = data.cp > 1 or want.stop - want.start != data.global_rows
        return split and self.rows is None and self.seq_dim is None and self.tokens is None

    def _tokens(self, r: torch.Tensor) -> torch.Tensor:
        """Flattened tokens (a router's or an MoE block's ``(rows x seq, ...)``): this call's rows and sequence
        chunks, flattened again."""
        r = r.unflatten(0, self.tokens)
        if self.rows is not None:
            r = r[self.rows]
        if self.cp > 1:
            from titanlike.parallel.context_parallel import cp_shard

            r = cp_shard(r, self.cp, self.cp_rank, dim=1)
        return r.flatten(0, 1)


def describe_placement(t) -> str:
    """A tensor's layout in words: a DTensor's placements over its mesh dims, or ``local``."""
    if isinstance(t, DTensor):
        names = t.device_mesh.mesh_dim_names or tuple(str(i) for i in range(t.device_mesh.ndim))
        return ", ".join(f"{n}: {_placement(p)}" for n, p in zip(names, t.placements))
    return "local"


def _placement(p) -> str:
    if isinstance(p, _StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return repr(p) if not isinstance(p, (Shard, Replicate)) else str(p)


def _weight_cut(weight, model_dims: dict, ref_size: int, local_size: int) -> torch.Tensor | None:
    """Index of the reference's last dim that a tensor cut like ``weight`` along some dim holds (None: no such dim)."""
    if not isinstance(weight, DTensor):
        return None
    names = weight.device_mesh.mesh_dim_names or ()
    local = weight.to_local()
    for e in range(weight.dim()):
        if weight.shape[e] != ref_size or local.shape[e] != local_size or local_size == ref_size:
            continue
        placements = [
            p if (isinstance(p, (Shard, _StridedShard)) and p.dim == e and n in model_dims) else Replicate()
            for n, p in zip(names, weight.placements)
        ]
        placements = [_on_dim0(p) for p in placements]
        index = torch.arange(ref_size).unsqueeze(1)
        cut = distribute_tensor(index, weight.device_mesh, placements, src_data_rank=None).to_local().flatten()
        if cut.numel() == local_size:
            return cut
    return None


def _on_dim0(p):
    """``p`` moved to dim 0 (the index tensor's only sharded dim)."""
    if isinstance(p, _StridedShard):
        return _StridedShard(0, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return Shard(0)
    return p


def cut_for(t: torch.Tensor, ref: torch.Tensor, data: DataCut, micro: int, weight=None) -> Cut | str | None:
    """The cut of ``ref`` that ``t`` holds; :data:`PENDING` for a Partial DTensor; None when no cut explains it."""
    rows = None
    shape = list(ref.shape)
    local = list(t.shape) if not isinstance(t, DTensor) else list(t.shape)
    want = data.rows_of(micro)
    n_rows = want.stop - want.start
    if _flat_tokens(ref, local, data, n_rows):
        if isinstance(t, DTensor) or local[1:] != shape[1:]:
            return None
        return Cut(want, None, data.cp, data.cp_rank, tokens=(data.global_rows, data.seq_len))
    if ref.dim() >= 1 and shape[0] == data.global_rows and (n_rows != data.global_rows) and local[:1] == [n_rows]:
        rows, shape[0] = want, n_rows
    seq_dim = None
    if data.cp > 1 and data.seq_len:
        for d in range(1, ref.dim()):
            if shape[d] == data.seq_len and d < len(local) and data.seq_len % local[d] == 0 and local[d] < shape[d]:
                seq_dim, shape[d] = d, shape[d] // data.cp
                break
    cut = Cut(rows, seq_dim, data.cp, data.cp_rank)
    if isinstance(t, DTensor):
        if list(t.shape) != shape:
            return None
        if any(p.is_partial() for p in t.placements):
            return PENDING
        cut.dtensor = (t.device_mesh, tuple(t.placements))
        return cut
    if len(local) != len(shape):
        return None
    for d in range(len(shape)):
        if local[d] == shape[d]:
            continue
        if d == len(shape) - 1 and weight is not None:
            cut.last = _weight_cut(weight, data.model_dims, shape[d], local[d])
            if cut.last is not None:
                continue
        if d == 0 or local[d] == 0 or shape[d] % local[d]:
            return None  # dim 0 is the batch (cut above) or flattened tokens (no contiguous cut explains those)
        parts = shape[d] // local[d]
        dims = [coord for size, coord in data.model_dims.values() if size == parts]
        if not dims:
            return None
        cut.chunks.append((d, parts, dims[0]))
    return cut


def _flat_tokens(ref: torch.Tensor, local: list[int], data: DataCut, n_rows: int) -> bool:
    """Dim 0 of ``ref`` is the global batch's tokens flattened and the local tensor holds this call's share of them
    (its rows, its context-parallel chunks), flattened the same way."""
    if not data.seq_len or ref.dim() < 1 or not local:
        return False
    total = data.global_rows * data.seq_len
    return ref.shape[0] == total and local[0] != total and local[0] == n_rows * data.seq_len // data.cp


def max_diff(local: torch.Tensor, expected: torch.Tensor) -> float:
    """max |local - expected| in float64 (inf when the shapes differ, NaN counted as inf)."""
    if isinstance(local, DTensor):
        local = local.to_local()
    if local.shape != expected.shape:
        return float("inf")
    if local.numel() == 0:
        return 0.0
    d = (local.detach().to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    return d if d == d else float("inf")
