"""One optimizer step: forward/backward over the micro-batches, gradient-norm clipping, the update.

The loss contract that makes every layout train like one device:

* the loss is the mean over **all** non-ignored tokens of the **global** batch (not a mean of per-rank or
  per-micro-batch means): every micro-batch contributes ``sum(CE) / global_tokens``, where ``global_tokens`` is
  counted once per step with one all-reduce over the data-parallel ranks;
* gradients are therefore *summed* over micro-batches, pipeline microbatches and data-parallel ranks (the FSDP
  wrapper is told not to average);
* the reported loss is the sum of those contributions over the data-parallel ranks (and taken from the last
  pipeline stage), identical on every rank.

Every sum of a step across micro-batches and ranks — the token count, the loss, the gradients, the gradient norm's
sum of squares — goes through ONE seam: ``reduction``. Without one (the default) the token count and the loss are
all-reduced here, FSDP reduce-scatters each micro-batch's gradients and ``clip_fn`` all-reduces the norm: sums whose
order depends on the layout (equal to one device within float64 rounding). With a
:class:`~titanlike.parallel.invariant.InvariantReduction` (``training.layout_invariant``) every one of them is summed
in the canonical tree that no layout changes: the same bits under every layout.

This module is used by the trainer and, unchanged, by the numerics tests.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanlike.loss import IGNORE_INDEX, ScaledLoss
from titanlike.parallel.coverage import check_dp_coverage


def model_kwargs(micro_batch: Sequence[torch.Tensor]) -> dict:
    """The model's keyword arguments carried by a micro-batch: ``(inputs, labels)`` none, ``(inputs, labels,
    document_starts)`` (document masking, ``titanlike.models.masking``) the block-causal mask's starts."""
    if len(micro_batch) == 2:
        return {}
    if len(micro_batch) == 3:
        return {"document_starts": micro_batch[2]}
    raise ValueError(f"a micro-batch is (inputs, labels) or (inputs, labels, document_starts), got {len(micro_batch)}")


def count_tokens(micro_batches: Sequence[Sequence[torch.Tensor]], dp_group=None) -> torch.Tensor:
    """Non-ignored label tokens of this step's global batch (summed over the data-parallel ranks)."""
    n = sum((mb[1] != IGNORE_INDEX).sum() for mb in micro_batches)
    n = torch.as_tensor(n, dtype=torch.float64, device=micro_batches[0][1].device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(n, group=dp_group)
    return n


@dataclass
class StepResult:
    loss: float  # mean CE over the global batch's tokens, identical on every rank
    grad_norm: float  # global gradient norm before clipping, identical on every rank
    tokens: int  # non-ignored tokens of the global batch
    skipped: bool  # True when loss or grad norm was not finite and the update was skipped
    moe: dict | None = None  # a model with MoE blocks: the aux loss per layer and the global expert loads
    mtp: list[float] | None = None  # a model with MTP depths: each depth's loss over the global batch's tokens
    committed: bool = True  # replica groups (fault_tolerance): False when the step failed and nothing was updated
    lr: float | None = None  # the learning rate of this step's update (read before the scheduler steps)


def forward_backward(
    model_parts: list[nn.Module],
    micro_batches: Sequence[Sequence[torch.Tensor]],
    loss: ScaledLoss,
    *,
    dp_group=None,
    pp_schedule=None,
    pp_group=None,
    has_last_stage: bool = True,
    forward_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    replicas=None,
    reduction=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run forward and backward over this rank's micro-batches; return (global mean loss, global token count).

    Without pipelining, ``model_parts`` is one module mapping token ids to logits. With pipelining,
    ``pp_schedule.step`` splits each micro-batch into the schedule's microbatches; only the last stage sees
    labels and losses. A micro-batch ``(inputs, labels, document_starts)`` runs the block-causal mask
    (:func:`model_kwargs`). ``forward_ctx`` (e.g. bf16 autocast) wraps the forward and loss, not the backward.
    ``replicas`` (fault-tolerant replica groups, ``titanlike.training.fault_tolerance``): the token count is summed
    over the groups that take part in the step. ``reduction`` (an ``InvariantReduction``): every sum in its tree.
    """
    if reduction is not None:
        return _invariant_forward_backward(
            model_parts, micro_batches, loss, forward_ctx, reduction, pp_schedule, has_last_stage
        )
    tokens = count_tokens(micro_batches, dp_group)
    if replicas is not None:
        tokens = replicas.sum_tokens(tokens)
    loss.denominator = tokens
    device = micro_batches[0][0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        inputs, labels, kwargs = mb[0], mb[1], model_kwargs(mb)
        if pp_schedule is None:
            with forward_ctx():
                out = loss(model_parts[0](inputs, **kwargs), labels)
            out.backward()
            total += out.detach().to(torch.float64)
        else:
            losses: list[torch.Tensor] = []
            targets = labels if has_last_stage else None
            if any(getattr(m, "wants_token_ids", False) for m in model_parts):  # MTP depths on the last stage
                kwargs["token_ids"] = inputs
            # keyword tensors are split by microbatch like the inputs: each microbatch keeps its document starts
            pp_schedule.step(inputs, target=targets, losses=losses, **kwargs)
            if has_last_stage:
                total += sum(l.detach().to(torch.float64) for l in losses)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)  # only the last stage contributed
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    return total, tokens


def _invariant_forward_backward(
    model_parts, micro_batches, loss: ScaledLoss, forward_ctx, reduction, pp_schedule=None, has_last_stage=True
):
    """``forward_backward`` of a layout-invariant run: the token count, each canonical microbatch's gradients (a
    leaf of the tree, taken after its backward; under a pipeline schedule each pipeline microbatch's, taken by the
    stages' backward passes with its microbatch index) and the loss summed by ``reduction``
    (``titanlike.parallel.invariant``)."""
    tokens = reduction.tokens(micro_batches, IGNORE_INDEX)
    loss.denominator = tokens
    reduction.begin_step()
    leaves = []
    for mb in micro_batches:
        if pp_schedule is not None:
            losses: list[torch.Tensor] = []
            pp_schedule.step(mb[0], target=mb[1] if has_last_stage else None, losses=losses, **model_kwargs(mb))
            leaves += [x.detach() for x in losses] if has_last_stage else []
        else:
            with forward_ctx():
                out = loss(model_parts[0](mb[0], **model_kwargs(mb)), mb[1])
            out.backward()
            leaves.append(out.detach())
        reduction.microbatch_done()
    reduction.finish_gradients()
    return reduction.loss(leaves), tokens


def train_step(
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Sequence[torch.Tensor]],
    loss: ScaledLoss,
    *,
    max_norm: float,
    clip_fn: Callable[..., torch.Tensor],
    lr_scheduler=None,
    dp_group=None,
    pp_schedule=None,
    pp_group=None,
    has_last_stage: bool = True,
    forward_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    moe=None,
    replicas=None,
    reduction=None,
) -> StepResult:
    """zero_grad -> forward/backward -> global grad norm (clip) -> finite check -> optimizer step.

    ``loss`` must be a :class:`~titanlike.loss.ScaledLoss` (a plain function would silently ignore the global token
    count: refused). With ``dp_group`` of more than one rank every trainable parameter must be covered by a
    data-parallel reduction (``titanlike.parallel.coverage``: refused on the first step, naming them).

    ``moe`` (``titanlike.parallel.expert_parallel.ExpertBalancing``, a model with MoE blocks): its ``begin_step``
    sets the aux loss's global denominator before the forward, its ``end_step`` updates the expert biases from the
    global loads after the optimizer step (not after a skipped one).

    ``clip_fn(parameters, max_norm) -> total_norm`` must return the norm over every parameter of the model on
    every rank (the parallel layer supplies one that reduces across DTensor meshes and pipeline stages). A
    non-finite loss or norm, identical on every rank by construction, skips the update on every rank.

    ``replicas`` (``titanlike.training.fault_tolerance.ReplicaGroups``): the token count, the gradients and the loss
    are summed over the replica groups of the step before the norm, and the update waits for every group to commit
    (a failed step updates nothing, not even the LR schedule: ``StepResult.committed`` is False).

    ``reduction`` (``ParallelModel.reduction``, a layout-invariant run): the token count, the loss and the gradients
    summed in its canonical tree (its ``clip_grad_norm_`` is then ``clip_fn``).
    """
    _check_loss(loss)
    check_dp_coverage(model_parts, dp_group)
    for m in model_parts:
        m.zero_grad(set_to_none=True)
    if moe is not None:
        moe.begin_step(micro_batches)
    total, tokens = forward_backward(
        model_parts,
        micro_batches,
        loss,
        dp_group=dp_group,
        pp_schedule=pp_schedule,
        pp_group=pp_group,
        has_last_stage=has_last_stage,
        forward_ctx=forward_ctx,
        replicas=replicas,
        reduction=reduction,
    )
    mtp = _mtp_losses(loss, total.device, dp_group, pp_group)
    if replicas is not None:
        total = replicas.sum_gradients(total)
    params = [p for m in model_parts for p in m.parameters()]
    loss_value, norm_value, mtp_values = _read_step_numbers(total, clip_fn(params, max_norm), mtp)
    finite = math.isfinite(loss_value) and math.isfinite(norm_value)
    lr = float(optimizer.param_groups[0]["lr"])  # the rate this update uses (the scheduler moves it on below)
    if replicas is not None and not replicas.should_commit():
        return StepResult(
            loss=loss_value, grad_norm=norm_value, tokens=int(tokens), skipped=True, committed=False, lr=lr
        )
    _update(optimizer, lr_scheduler, finite)
    moe_stats = moe.end_step(update=finite) if moe is not None else None
    return StepResult(
        loss=loss_value,
        grad_norm=norm_value,
        tokens=int(tokens),
        skipped=not finite,
        moe=moe_stats,
        mtp=mtp_values or None,
        lr=lr,
    )


def _read_step_numbers(total: torch.Tensor, norm, mtp: torch.Tensor) -> tuple[float, float, list[float]]:
    """The step's loss, gradient norm and MTP depth losses on the host: one device-to-host copy for all of them (one
    host sync per step, not two)."""
    loss_value, norm_value, *mtp_values = torch.cat(
        [torch.stack([total, torch.as_tensor(norm, dtype=torch.float64, device=total.device)]), mtp]
    ).tolist()
    return loss_value, norm_value, mtp_values


def _check_loss(loss) -> None:
    """``train_step``'s loss must divide by the global token count it sets: a :class:`ScaledLoss`, else one line."""
    if not isinstance(loss, ScaledLoss):
        raise TypeError(
            f"train_step: loss must be a ScaledLoss (it divides the summed loss by the global token count, which "
            f"train_step sets as loss.denominator every step), got {type(loss).__name__}; pass "
            f"ScaledLoss(loss_fn) with loss_fn(output, labels) returning the SUM over tokens (from titanlike.parallel "
            f"import ScaledLoss), or the .loss of build_parallel_model / pipeline_module"
        )


def _update(optimizer: torch.optim.Optimizer, lr_scheduler, finite: bool) -> None:
    """The optimizer step (only when the loss and the norm are finite) and the LR schedule's (always)."""
    if finite:
        optimizer.step()
    if lr_scheduler is not None and finite:
        lr_scheduler.step()
    elif lr_scheduler is not None:
        # A skipped update still advances the schedule: the learning rate follows the step number, which counts
        # skipped steps too. torch warns that the scheduler stepped before the optimizer when the very first update
        # is the one skipped; that order is intended here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            lr_scheduler.step()


def _mtp_losses(loss: ScaledLoss, device, dp_group, pp_group) -> torch.Tensor:
    """Each MTP depth's loss of this step (``ScaledLoss.take_mtp_losses``, summed over the last pipeline stage and
    the data-parallel ranks, like the loss); empty for a model without MTP depths."""
    parts = loss.take_mtp_losses()  # (a pipeline rank without the last stage: none, zeros of the depths)
    if parts:
        mtp = torch.stack(parts).to(torch.float64)
    else:
        mtp = torch.zeros(loss.mtp_depths, dtype=torch.float64, device=device)
    for group in (pp_group, dp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(mtp, group=group)
    return mtp


def reshard_fsdp(module: nn.Module) -> None:
    """Hand FSDP's sharded parameters back after a no-grad forward. The groups that keep their parameters after
    forward (the root, the head) stay unsharded otherwise, and the next training step then reported a wrong
    gradient norm and took a wrong update (fsdp 2 on the debug model: 0.794 instead of 0.464)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def eval_loss_sum(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    forward_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``loss_fn(model(inputs), labels)`` in eval mode, as float64, leaving the model ready to train again
    (``document_starts``: the block-causal mask, as in training)."""
    kwargs = {} if document_starts is None else {"document_starts": document_starts}
    model.eval()
    try:
        with forward_ctx():
            loss = loss_fn(model(inputs, **kwargs), labels)
    finally:
        model.train()
        reshard_fsdp(model)
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return loss.detach().to(torch.float64)
