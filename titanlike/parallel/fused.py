"""Tensor parallelism for fused projections: a Linear whose output is a concatenation of chunks.

GPT-2's ``c_attn`` computes ``q | k | v`` in one matmul, a fused MLP ``gate | up``. A plain ``ColwiseParallel``
gives rank ``r`` the ``r``-th contiguous block of output features, i.e. all of q and part of k on rank 0 of 2:
the attention then silently mixes q, k and v. :class:`FusedColwiseParallel` gives every rank the ``r``-th slice of
*each* chunk (its heads of q, of k and of v), with no reordering of the weight by the user.

Equal chunks (MHA q|k|v, gate|up):

* the parameters become DTensors with placement ``_StridedShard(0, split_factor=n_chunks)`` -- torch's placement
  for exactly this layout (split the dim into ``n`` pieces, shard each piece over the mesh): ``full_tensor()``,
  ``redistribute``, optimizer math and norms see the single-device order q|k|v;
* the forward is the local matmul of the replicated input with the local rows (no communication of its own,
  like ``ColwiseParallel``: the input gradient is ``Partial`` and the block's f operator all-reduces it), so the
  collectives are those of the unfused plan (pinned by tests/parallel/test_parallel_probes.py with CommDebugMode);
* the output is this rank's ``[q_r | k_r | v_r]`` as a local tensor (or a DTensor with ``_StridedShard(-1)``).

Checkpoints: DCP writes one contiguous block per rank and refuses a strided layout ("overlapping chunks"), so
:func:`contiguous_for_dcp` turns such DTensors (model or optimizer state) into plain ``Shard`` layouts of the same
global tensor before a save / load, and :func:`restore_layout` copies loaded values back: the files hold the
single-device order and load under any other layout (tests: tp2 -> tp1, HF export).

Unequal chunks (grouped-query q|k|v: ``FusedColwiseParallel([n_q*hd, n_kv*hd, n_kv*hd])``, q larger than k and
v) have no DTensor placement that survives the optimizer (below), so they take the fallback the module already uses
for chunk-sharded biases under FSDP:

* the weight and bias stay DTensors **Replicate over tp**: single-device order everywhere (``full_tensor()``, the
  state dict, DCP, resharding, HF export), and FSDP shards them over dp like any replicated parameter;
* the forward cuts this rank's rows, the ``r``-th tp slice of each chunk (rank ``r`` gets q heads
  ``r*n_q/tp ...`` and kv heads ``r*n_kv/tp ...``: the ``repeat_interleave`` grouping, q head ``i`` with kv head
  ``i // (n_q/n_kv)``), from the local tensor taken with ``to_local(grad_placements=[Partial()])``: each rank's
  gradient (zero outside its rows) is a ``Partial`` sum over tp;
* its price: **one all-reduce over tp of the full weight's gradient (``out x in`` elements) and one of the bias's
  (``out``) per Linear per step** (done by the post-accumulate-grad hook of ``apply_tp`` that gives each gradient
  its parameter's placements, or by FSDP's gradient reduction, which redistributes to the tp placement first), on
  top of the collectives of separate q / k / v ``ColwiseParallel`` projections (pinned by
  tests/parallel/test_parallel_probes.py); and the weight's memory (parameter, gradient, optimizer state) is
  **not divided by tp**, only by FSDP's dp. When memory or bandwidth matters, use separate q, k, v Linears
  (``ColwiseParallel`` each), as the Llama model does.

Each chunk size must divide by tp (else a one-line error naming the sizes and tp); the output is this rank's
``[q_r | k_r | v_r]`` as a local tensor (``use_local_output=False`` is refused: no placement describes it).

Why no placement: ``_StridedShard(0, split_factor=n)`` gives rank ``r`` the ``r``-th slice of each of ``n`` *equal*
pieces; for q = g x kv rows (g > 1) no ``n`` gives rank ``r`` one contiguous block of q plus its blocks of k and v.
A private ``Shard`` subclass carrying the chunk sizes (own ``_split_tensor`` / ``_to_replicate_tensor``) was
measured (docs/facts.md, "No DTensor placement for unequal chunks"): ``DTensorSpec`` accepts a shard placement
only if it compares equal to ``Shard(dim)``, and then sharding propagation rebuilds out-of-place pointwise results
(``mul``, ``sqrt``, ``div``, ``clone()``, ``.to(dtype)``: the model-only checkpoint's cast) as plain ``Shard(0)``,
so the sizes are silently lost and ``full_tensor()`` / checkpoints come out in rank-major order; a subclass that
compares unequal is refused by ``DTensorSpec``. Permuting the rows internally to rank-major order (plain ``Shard``)
would make ``full_tensor()`` return the permuted weight, which the single-device-order contract forbids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from titanlike.parallel.replica_check import ReplicaCheck

__all__ = [
    "FusedColwiseParallel",
    "contiguous_for_dcp",
    "contiguous_for_dcp_tree",
    "restore_layout",
    "is_strided",
    "prepare_fused_for_fsdp",
    "fsdp_placement",
    "gather_strided",
]


FUSED_ADVICE = (
    "its input must be the replicated stream: a sequence shard needs PrepareModuleInput(input_layouts=Shard(1), "
    "desired_input_layouts=Replicate()) on the module around it, or a DTensor input"
)


class FusedColwiseParallel(ParallelStyle):
    """Column-wise parallel ``nn.Linear`` whose output features are a concatenation of chunks, each sharded over tp.

    ``chunks``: the number of equal chunks (3 for MHA q|k|v, 2 for gate|up) or their sizes, e.g.
    ``[n_heads * hd, n_kv_heads * hd, n_kv_heads * hd]``. Equal sizes: ``_StridedShard`` parameters, no extra
    communication. Unequal sizes (grouped-query q|k|v): parameters replicated over tp, each rank cutting its rows
    in the forward; costs one all-reduce of the weight's and one of the bias's gradient over tp per step, and the
    weight is not divided by tp (module docstring). Every chunk must divide by tp. The input is taken as replicated
    (a DTensor is redistributed to ``Replicate`` first; a plain tensor is checked to be the same on every tp rank,
    ``check`` as in :class:`~titanlike.parallel.tensor_parallel.ReplicateParallel`); ``use_local_output=True``
    returns this rank's local
    ``[chunk_0 | chunk_1 | ...]`` slices, concatenated. ``head_dim`` (optional): also require whole heads per rank
    (each chunk's head count divisible by tp), so a rank never gets part of a kv head.
    """

    def __init__(
        self,
        chunks: int | Sequence[int],
        *,
        use_local_output: bool = True,
        head_dim: int | None = None,
        check: str = "first",
    ):
        super().__init__()
        self.check = check
        ReplicaCheck(check, type(self).__name__, FUSED_ADVICE, parameters=False)  # validates check
        if isinstance(chunks, int):
            if chunks < 1:
                raise ValueError(f"FusedColwiseParallel: chunks must be >= 1, got {chunks}")
            self.n_chunks, self.sizes = chunks, None
        else:
            sizes = [int(c) for c in chunks]
            if not sizes or any(c < 1 for c in sizes):
                raise ValueError(f"FusedColwiseParallel: chunk sizes must be positive, got {sizes}")
            self.n_chunks, self.sizes = len(sizes), sizes
        self.unequal = self.sizes is not None and len(set(self.sizes)) > 1
        if self.unequal and not use_local_output:
            raise ValueError(
                f"FusedColwiseParallel: chunk sizes {self.sizes} differ, so the output "
                f"[chunk_0 slice | chunk_1 slice | ...] has no DTensor placement; use "
                f"use_local_output=True"
            )
        if head_dim is not None and head_dim < 1:
            raise ValueError(f"FusedColwiseParallel: head_dim must be >= 1, got {head_dim}")
        self.use_local_output, self.head_dim = use_local_output, head_dim

    def _placement(self):
        return Replicate() if self.unequal else _StridedShard(0, split_factor=self.n_chunks)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwiseParallel applies to nn.Linear, got {type(module).__name__}")
        out = module.out_features
        tp = device_mesh.size()
        if self.sizes is not None and sum(self.sizes) != out:
            raise ValueError(
                f"FusedColwiseParallel: chunk sizes {self.sizes} add up to {sum(self.sizes)}, the "
                f"Linear has {out} output features"
            )
        if self.unequal and any(c % tp for c in self.sizes):
            raise ValueError(
                f"FusedColwiseParallel: chunk sizes {self.sizes} must each divide by tp {tp} (each rank "
                f"takes 1/{tp} of every chunk: whole heads of q, k and v)"
            )
        if not self.unequal and out % (self.n_chunks * tp):
            raise ValueError(
                f"FusedColwiseParallel: {out} output features do not split into {self.n_chunks} chunks x tp {tp}"
            )
        sizes = self.sizes or [out // self.n_chunks] * self.n_chunks
        if self.head_dim and any(c % self.head_dim or (c // self.head_dim) % tp for c in sizes):
            raise ValueError(
                f"FusedColwiseParallel: chunk sizes {sizes} hold {[c / self.head_dim for c in sizes]} "
                f"heads of {self.head_dim}; each chunk's head count must divide by tp {tp} (whole heads "
                f"per rank: n_heads and n_kv_heads divisible by tp)"
            )
        for name, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.data if not isinstance(p, DTensor) else p, device_mesh, [self._placement()])
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        n_chunks, use_local_output = self.n_chunks, self.use_local_output
        replica_check = ReplicaCheck(self.check, type(self).__name__, FUSED_ADVICE, parameters=False)
        module._titanlike_replica_check = replica_check

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, DTensor):
                replica_check(module, x, device_mesh)  # a replica: its gradient is all-reduced when leaving the DTensor
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            elif tuple(x.placements) != (Replicate(),):
                x = x.redistribute(device_mesh, [Replicate()])
            # Each rank's input gradient covers only its output features: a Partial sum (the f operator reduces).
            x_local = x.to_local(grad_placements=[Partial()])
            w = _local_rows(module.weight, device_mesh, sizes)
            b = _local_rows(module.bias, device_mesh, sizes)
            y = F.linear(x_local, w, b)
            if use_local_output:
                return y
            return DTensor.from_local(
                y, device_mesh, [_StridedShard(y.ndim - 1, split_factor=n_chunks)], run_check=False
            )

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(chunks={self.sizes or self.n_chunks}, "
            f"use_local_output={self.use_local_output}, head_dim={self.head_dim})"
        )


def _local_rows(param, device_mesh, sizes):
    """This rank's rows of a fused weight or bias, ``[chunk_0 slice r | chunk_1 slice r | ...]``: its local tensor
    when chunk-sharded (``_StridedShard``), or, when the parameter is replicated over tp (unequal chunks, or a bias
    made replicated for FSDP by :func:`prepare_fused_for_fsdp`), the slices cut from the full tensor, taken with a
    ``Partial`` gradient placement: each rank's gradient (zero outside its rows) is summed over tp."""
    if param is None:
        return None
    tp_dim = param.device_mesh.ndim - 1
    if isinstance(param.placements[tp_dim], Replicate):
        full = param.to_local(grad_placements=[*param.placements[:tp_dim], Partial()])
        r, tp = device_mesh.get_local_rank(), device_mesh.size()
        return torch.cat([c.chunk(tp)[r] for c in full.split(sizes)])
    return param.to_local()


# ------------------------------------------------------------------------------------------------- FSDP
def prepare_fused_for_fsdp(model: nn.Module) -> None:
    """Before ``fully_shard``: FSDP splits a parameter's local tensor contiguously along a dim; for a chunk-sharded
    1-D bias (``[q_r | k_r | v_r]``) that gives a layout no DTensor placement describes (``full_tensor()`` would be
    wrong). Such biases become replicated over tp (a one-off all-gather; FSDP then shards them like any replicated
    parameter) and :class:`FusedColwiseParallel` cuts the local slices in the forward. Costs one all-reduce of the
    bias gradient over tp per step; 2-D weights are sharded by FSDP on dim 1 instead (:func:`fsdp_placement`)."""
    for module in model.modules():
        bias = module._parameters.get("bias") if hasattr(module, "_parameters") else None
        if bias is not None and bias.ndim == 1 and is_strided(bias):
            new = nn.Parameter(gather_strided(bias.detach()), requires_grad=bias.requires_grad)
            module.register_parameter("bias", new)


def gather_strided(t: DTensor) -> DTensor:
    """The same global tensor with the tp dim's ``_StridedShard(d, split_factor=n)`` made ``Replicate`` (an
    all-gather over tp); the other mesh dims keep their placements.

    Not ``t.redistribute``: torch 2.11's redistribute planner refuses a ``_StridedShard`` whose split factor is no
    product of mesh sizes ("use_strided_shard_as_shard_order is True, but placements ... is unable to be
    interpreted into a corresponding shard_order"; 2.13 falls back to its greedy plan). The chunked layout is a plain
    one in another view: with dim ``d`` unflattened into ``(n, size / n)``, this rank's local tensor is
    ``Shard(d + 1)`` of the global tensor viewed the same way, which every torch redistributes."""
    mesh, tp_dim = t.device_mesh, t.device_mesh.ndim - 1
    strided = t.placements[tp_dim]
    d, n = strided.dim, strided.split_factor
    view = []
    for p in t.placements[:tp_dim]:
        if isinstance(p, _StridedShard) or (isinstance(p, Shard) and p.dim == d):
            raise ValueError(f"gather_strided: placements {t.placements} shard the chunked dim {d} twice")
        view.append(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim > d else p)
    shape = (*t.shape[:d], n, t.shape[d] // n, *t.shape[d + 1 :])
    local = DTensor.from_local(
        t.to_local().unflatten(d, (n, -1)),
        mesh,
        [*view, Shard(d + 1)],
        run_check=False,
        shape=shape,
        stride=_contiguous(shape),
    )
    gathered = local.redistribute(mesh, [*view, Replicate()]).to_local().flatten(d, d + 1)
    placements = [*t.placements[:tp_dim], Replicate()]
    return DTensor.from_local(gathered, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _contiguous(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def fsdp_placement(param: nn.Parameter):
    """FSDP's shard placement: dim 1 for chunk-sharded 2-D weights (dim 0 is the chunked one), else FSDP's default."""
    if is_strided(param) and param.ndim >= 2:
        return Shard(1)
    return None


# ------------------------------------------------------------------------------------------------- checkpoints
def is_strided(t) -> bool:
    """A DTensor whose local data is not one contiguous block of the global tensor (a chunked layout)."""
    if not isinstance(t, DTensor):
        return False
    ndim = t.device_mesh.ndim
    for i, p in enumerate(t.placements):
        if isinstance(p, _StridedShard) and i == ndim - 1:  # FSDP's own strided dp dim (i < last) stays contiguous
            return True
    return False


def _contiguous_placements(t: DTensor):
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]


def contiguous_for_dcp(flat: dict) -> dict:
    """The same dict with every chunk-sharded DTensor replaced by a plain-``Shard`` DTensor of the same global
    tensor (new storage; local slicing of the full tensor, no scatter), which DCP can save and load into."""
    out = {}
    for k, v in flat.items():
        if is_strided(v):
            full = gather_strided(v).full_tensor()
            out[k] = distribute_tensor(full, v.device_mesh, _contiguous_placements(v), src_data_rank=None)
        else:
            out[k] = v
    return out


def contiguous_for_dcp_tree(obj):
    """:func:`contiguous_for_dcp` through nested dicts / lists (a model or optimizer state dict)."""
    if isinstance(obj, dict):
        return {k: contiguous_for_dcp_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [contiguous_for_dcp_tree(v) for v in obj]
    return contiguous_for_dcp({"x": obj})["x"] if is_strided(obj) else obj


@torch.no_grad()
def restore_layout(loaded: dict, originals: dict) -> dict:
    """After a DCP load into :func:`contiguous_for_dcp`'s tensors: values in the original (chunked) layouts."""
    out = {}
    for k, v in loaded.items():
        orig = originals.get(k)
        if is_strided(orig) and isinstance(v, DTensor):
            full = v.full_tensor()
            out[k] = distribute_tensor(full, orig.device_mesh, orig.placements, src_data_rank=None)
        else:
            out[k] = v
    return out
