"""Vocab-parallel cross entropy (Megatron-style): the loss of vocab-sharded logits without gathering them.

Each tensor-parallel rank holds the logits of a contiguous vocabulary slice ``[vocab_start, vocab_start + V_local)``.
Per row (token), the forward all-reduces three row vectors over the tp group, in this order:

1. MAX of the local row max                 -> global max ``m``
2. SUM of the local ``sum(exp(logit - m))`` -> global softmax denominator ``s``
3. SUM of the target logit, contributed by the rank whose slice holds the label (0 elsewhere)

and ``loss = log(s) + m - target``, identical on every rank. The backward needs no communication: the
local slice of ``softmax - one_hot`` is ``exp(logit - (log(s) + m))`` minus 1 at the label if this rank
owns it. Only the local logits (in their own dtype) and one float per row are saved; with ``chunk_size``
the forward and backward work on that many rows at a time (three all-reduces per chunk), so the float32
working set is O(chunk_size * V_local).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from titanlike.loss import IGNORE_INDEX, compute_dtype, flatten_tokens, reduce_loss, row_chunks

__all__ = ["vocab_parallel_cross_entropy", "loss_parallel_cross_entropy"]


def _all_reduce(t: Tensor, op: dist.ReduceOp, group) -> Tensor:
    """In-place all-reduce of ``t`` over ``group``; the only communication in this module."""
    dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over rows of the cross entropy of the full (sharded) logits; see the module docstring."""

    @staticmethod
    def forward(
        ctx, local_logits: Tensor, labels: Tensor, vocab_start: int, group, ignore_index: int, chunk_size: int | None
    ) -> Tensor:
        dtype = compute_dtype(local_logits.dtype)
        rows, local_vocab = local_logits.shape
        valid = labels != ignore_index
        owned = valid & (labels >= vocab_start) & (labels < vocab_start + local_vocab)
        local_labels = torch.where(owned, labels - vocab_start, 0)
        lse = torch.empty(rows, dtype=dtype, device=local_logits.device)
        loss = torch.zeros((), dtype=dtype, device=local_logits.device)
        for r in row_chunks(rows, chunk_size):
            x = local_logits[r].to(dtype)
            if local_vocab:
                row_max = x.amax(dim=-1)
            else:  # an empty shard (vocab smaller than the group) contributes nothing
                row_max = x.new_full((x.shape[0],), float("-inf"))
            row_max = _all_reduce(row_max, dist.ReduceOp.MAX, group)
            sum_exp = torch.sub(x, row_max[:, None]).exp_().sum(dim=-1)
            sum_exp = _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            if local_vocab:
                target = torch.where(owned[r], x.gather(1, local_labels[r, None]).squeeze(1), 0)
            else:
                target = x.new_zeros(x.shape[0])
            target = _all_reduce(target, dist.ReduceOp.SUM, group)
            lse[r] = sum_exp.log_().add_(row_max)
            loss += torch.where(valid[r], lse[r] - target, 0).sum()
        ctx.save_for_backward(local_logits, local_labels, owned, valid, lse)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        local_logits, local_labels, owned, valid, lse = ctx.saved_tensors
        scale = torch.where(valid, grad_loss.to(lse.dtype), 0)
        grad = torch.empty_like(local_logits)
        if local_logits.shape[1]:
            for r in row_chunks(local_logits.shape[0], ctx.chunk_size):
                # A new tensor even when the logits already have the compute dtype (.to would alias them).
                probs = torch.sub(local_logits[r].to(lse.dtype), lse[r, None]).exp_()
                probs.scatter_add_(1, local_labels[r, None], -owned[r, None].to(probs.dtype))
                grad[r] = probs.mul_(scale[r, None])
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    labels: Tensor,
    *,
    vocab_start: int,
    group,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    chunk_size: int | None = None,
) -> Tensor:
    """Cross entropy of logits whose vocabulary dim is split over the ranks of ``group``.

    Args:
        local_logits: (..., V_local) this rank's slice of the logits, columns
            ``[vocab_start, vocab_start + V_local)`` of the full vocabulary; the slices of the ranks
            must tile the vocabulary.
        labels: (...) full-vocabulary class indices, the same on every rank of ``group``. A label outside
            the vocabulary (other than ``ignore_index``) is owned by no rank and is not detected (checking
            would cost a device sync every step).
        group: the process group the vocabulary is split over (None: the default group).
        ignore_index, reduction, chunk_size: as in ``titanlike.loss.cross_entropy_loss``.

    Returns the loss of the full logits (0-dim, at least float32), identical on all ranks of ``group``.
    Its backward gives each rank the gradient of its own slice, without communication.
    """
    logits2d, labels1d = flatten_tokens(local_logits, labels, reduction, chunk_size)
    loss_sum = _VocabParallelCrossEntropy.apply(logits2d, labels1d, vocab_start, group, ignore_index, chunk_size)
    return reduce_loss(loss_sum, labels1d, ignore_index, reduction)


def _shard_size_and_offset(size: int, num_shards: int, index: int) -> tuple[int, int]:
    """Size and start of shard ``index`` when ``Shard`` splits ``size`` with ``torch.chunk`` semantics:
    ceil(size / num_shards) per shard, the last shards smaller or empty."""
    full = -(-size // num_shards)
    start = min(full * index, size)
    return min(full, size - start), start


def _vocab_mesh_dim(placements: Sequence[Placement], ndim: int) -> int:
    """The mesh dim that shards the last (vocab) tensor dim; every other mesh dim must replicate."""
    vocab_dims = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim % ndim == ndim - 1]
    others = [p for i, p in enumerate(placements) if i not in vocab_dims and not isinstance(p, Replicate)]
    if len(vocab_dims) != 1 or others:
        raise ValueError(
            "loss_parallel_cross_entropy needs logits sharded on the vocab (last) dim over exactly "
            f"one mesh dim and replicated over the others, got placements {tuple(placements)}"
        )
    return vocab_dims[0]


def loss_parallel_cross_entropy(
    logits: DTensor,
    labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    chunk_size: int | None = None,
) -> Tensor:
    """``vocab_parallel_cross_entropy`` of a DTensor whose vocab (last) dim is ``Shard`` ed on one mesh dim.

    ``labels`` is a plain tensor (or a replicated DTensor) of shape ``logits.shape[:-1]``, the same on
    all ranks. Returns a plain 0-dim tensor, the full loss, identical on all ranks of the mesh; its
    backward flows into ``logits`` (as a DTensor gradient with the same placements).
    """
    if not isinstance(logits, DTensor):
        raise TypeError(f"logits must be a DTensor, got {type(logits).__name__}")
    if isinstance(labels, DTensor):
        if not all(isinstance(p, Replicate) for p in labels.placements):
            raise ValueError(f"labels must be replicated, got placements {labels.placements}")
        labels = labels.to_local()
    mesh: DeviceMesh = logits.device_mesh
    mesh_dim = _vocab_mesh_dim(logits.placements, logits.ndim)
    local_logits = logits.to_local()
    vocab = logits.shape[-1]
    size, vocab_start = _shard_size_and_offset(vocab, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    if local_logits.shape[-1] != size:
        raise ValueError(
            f"local vocab shard has {local_logits.shape[-1]} columns, but Shard's torch.chunk layout "
            f"of {vocab} columns over {mesh.size(mesh_dim)} ranks gives {size} here"
        )
    return vocab_parallel_cross_entropy(
        local_logits,
        labels,
        vocab_start=vocab_start,
        group=mesh.get_group(mesh_dim),
        ignore_index=ignore_index,
        reduction=reduction,
        chunk_size=chunk_size,
    )
