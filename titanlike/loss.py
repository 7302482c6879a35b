"""The loss kernels, shared by the trainer and the parallel layer (which imports only the public names here).

``IGNORE_INDEX`` marks label tokens that count neither in the loss nor in the token count. ``ScaledLoss`` is the
loss contract's callable, ``loss_fn(output, labels) / denominator`` (see ``titanlike/training/step.py``).

``cross_entropy_loss`` is ``F.cross_entropy`` over flattened tokens, computed in at least float32, with
``reduction="sum"`` or ``"mean"`` over the non-ignored tokens (the mean of zero tokens is 0, not NaN).

Memory (the reason for ``chunk_size``): for T tokens and a vocabulary V, the plain path upcasts the logits
to float32, autograd keeps the float32 ``log_softmax`` output for the backward, and the backward builds a
float32 gradient before casting it to the logits dtype: several float32 (T x V) tensors are alive at the
peak. With ``chunk_size=c`` a custom autograd function saves only the logits in their own dtype plus one
logsumexp per token, and both the forward and the backward work on ``c`` rows at a time, writing the
gradient directly in the logits dtype, so the float32 working set is O(c*V) instead of O(T*V) (measured
peaks: docs/performance.md, "Memory-lean loss").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "ScaledLoss",
    "compute_dtype",
    "cross_entropy_loss",
    "flatten_tokens",
    "recording_paused",
    "reduce_loss",
    "row_chunks",
    "shift_labels",
]

IGNORE_INDEX = -100
REDUCTIONS = ("sum", "mean")


class ScaledLoss:
    """``loss_fn(output, labels) / denominator``; the denominator is set once per step (pipeline schedules hold
    on to the callable, so it is an object rather than a closure over a step-local value).

    **Multi-token prediction**: an ``output`` that is a tuple ``(logits, depth-1 logits, ..., depth-D logits)`` (a
    model with MTP depths in training mode: DeepSeek-V3) adds ``mtp_weight / D`` times each depth's loss, depth k
    against the labels shifted left by k (the last k positions ignored), over the same global-token denominator
    (DeepSeek-V3 eq. 24-25). The value returned stays the next-token loss exactly (``main + (mtp - mtp.detach())``:
    the depths enter the gradient only), so the logged ``loss`` is the cross entropy; each depth's detached
    ``loss_fn / denominator`` is added to ``mtp_losses`` (summed over the calls until :meth:`take_mtp_losses`)."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor], mtp_weight: float = 0.0, mtp_depths: int = 0):
        self.loss_fn = loss_fn
        self.denominator: Tensor | float = 1.0
        self.mtp_weight = mtp_weight
        self.mtp_depths = mtp_depths  # the model's MTP depths (what a rank that computed no loss reports: zeros)
        self.mtp_losses: list[Tensor] = []
        # the labels of MTP depth k (a swap point: context parallelism shifts the whole window's labels)
        self.shift_labels: Callable[[Tensor, int], Tensor] = shift_labels

    def __call__(self, output: Tensor | tuple[Tensor, ...], labels: Tensor) -> Tensor:
        if not isinstance(output, tuple):
            return self.loss_fn(output, labels) / self.denominator
        main = self.loss_fn(output[0], labels) / self.denominator
        depths = [self.loss_fn(o, self.shift_labels(labels, k)) / self.denominator for k, o in enumerate(output[1:], 1)]
        if not self.mtp_losses:
            self.mtp_losses = [torch.zeros((), dtype=torch.float64, device=main.device) for _ in depths]
        if not _RECORDING_PAUSED[0]:
            for total, d in zip(self.mtp_losses, depths):
                total += d.detach().to(torch.float64)
        mtp = sum(depths) * (self.mtp_weight / max(len(depths), 1))
        return main + (mtp - mtp.detach())

    def take_mtp_losses(self) -> list[Tensor]:
        """The depth losses summed since the last call (this rank's part), and reset."""
        out, self.mtp_losses = self.mtp_losses, []
        return out


_RECORDING_PAUSED = [0]


@contextlib.contextmanager
def recording_paused():
    """Loss calls that are not the step's (a pipeline stage's metadata inference at the first step) leave
    ``ScaledLoss.mtp_losses`` alone."""
    _RECORDING_PAUSED[0] += 1
    try:
        yield
    finally:
        _RECORDING_PAUSED[0] -= 1


def shift_labels(labels: Tensor, k: int) -> Tensor:
    """``labels`` (batch, seq) shifted left by ``k`` along the sequence, the last ``k`` positions ignored: the
    targets of the MTP depth ``k``."""
    pad = labels.new_full((*labels.shape[:-1], min(k, labels.shape[-1])), IGNORE_INDEX)
    return torch.cat([labels[..., k:], pad], dim=-1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def flatten_tokens(logits: Tensor, labels: Tensor, reduction: str, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """Validate the arguments and return logits as (tokens, vocab) and labels as (tokens,) int64."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be integer class indices, got {labels.dtype}")
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])}"
        )
    return logits.reshape(labels.numel(), logits.shape[-1]), labels.reshape(-1).long()


def reduce_loss(loss_sum: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """``loss_sum`` as is, or divided by the number of non-ignored tokens (at least 1, so 0 tokens give 0)."""
    if reduction == "sum":
        return loss_sum
    num_tokens = (labels != ignore_index).sum().clamp_(min=1)
    return loss_sum / num_tokens


def row_chunks(num_rows: int, chunk_size: int | None):
    """Row slices covering ``range(num_rows)``, ``chunk_size`` rows each (one slice if None)."""
    step = num_rows if chunk_size is None else chunk_size
    for start in range(0, num_rows, max(step, 1)):
        yield slice(start, min(start + step, num_rows))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``logsumexp(x) - x[label]``, computed ``chunk_size`` rows at a time.

    Saves the logits in their own dtype and the per-row logsumexp (compute dtype); the backward
    recomputes ``softmax - one_hot`` per chunk and writes the gradient in the logits dtype.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, ignore_index: int, chunk_size: int) -> Tensor:
        dtype = compute_dtype(logits.dtype)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, 0)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for rows in row_chunks(logits.shape[0], chunk_size):
            lse[rows] = torch.logsumexp(logits[rows].to(dtype), dim=-1)
        # The upcast is exact, so gathering before upcasting gives the same target logit.
        target = logits.gather(1, safe_labels[:, None]).squeeze(1).to(dtype)
        ctx.save_for_backward(logits, safe_labels, valid, lse)
        ctx.chunk_size = chunk_size
        return torch.where(valid, lse - target, 0).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        logits, safe_labels, valid, lse = ctx.saved_tensors
        # Per-row scale: the incoming scalar gradient on valid rows, 0 on ignored ones.
        scale = torch.where(valid, grad_loss.to(lse.dtype), 0)
        grad = torch.empty_like(logits)
        for rows in row_chunks(logits.shape[0], ctx.chunk_size):
            # A new tensor even when logits already have the compute dtype (.to would alias them).
            probs = torch.sub(logits[rows].to(lse.dtype), lse[rows, None]).exp_()
            probs.scatter_add_(1, safe_labels[rows, None], probs.new_full((probs.shape[0], 1), -1.0))
            grad[rows] = probs.mul_(scale[rows, None])
        return grad, None, None, None


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    chunk_size: int | None = None,
) -> Tensor:
    """Cross entropy of ``logits`` (..., vocab) against ``labels`` (...), in at least float32.

    Args:
        ignore_index: label value whose tokens contribute neither loss nor gradient.
        reduction: "sum" over non-ignored tokens, or "mean" over them (0 when there are none).
        chunk_size: if given, process this many tokens at a time in forward and backward so that no
            float32 (tokens x vocab) tensor is ever materialised (see the module docstring).

    Returns a 0-dim tensor of dtype ``promote_types(logits.dtype, float32)``.
    """
    logits2d, labels1d = flatten_tokens(logits, labels, reduction, chunk_size)
    if chunk_size is None:
        loss_sum = F.cross_entropy(
            logits2d.to(compute_dtype(logits.dtype)), labels1d, ignore_index=ignore_index, reduction="sum"
        )
    else:
        loss_sum = _ChunkedCrossEntropy.apply(logits2d, labels1d, ignore_index, chunk_size)
    return reduce_loss(loss_sum, labels1d, ignore_index, reduction)
