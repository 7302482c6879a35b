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
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from titanlike.loss import IGNORE_INDEX, ScaledLoss
from titanlike.parallel.coverage import check_dp_coverage
from titanlike.sharding import local_tensor


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


class StepResult:
    """One step's numbers. ``loss``, ``grad_norm``, ``tokens``, ``skipped`` and ``mtp`` stay on the device until one
    of them is first read (one device-to-host copy for all of them, then kept): a step the trainer does not log reads
    nothing on the host. ``read_together`` reads the numbers of many steps in one copy."""

    def __init__(self, numbers: torch.Tensor, *, moe=None, committed: bool = True, lr: float | None = None):
        self.numbers = numbers  # float64 on the device: loss, grad norm, tokens, skipped (1.0 / 0.0), MTP losses
        self.moe = moe  # a model with MoE blocks: the aux loss per layer and the global expert loads
        self.committed = committed  # replica groups (fault_tolerance): False when the step failed, nothing updated
        self.lr = lr  # the learning rate of this step's update (read before the scheduler steps)
        self._host: list[float] | None = None

    @staticmethod
    def read_together(results: Sequence[StepResult]) -> None:
        """Read the numbers of every result not read yet in one device-to-host copy."""
        todo = [r for r in results if r._host is None]
        widths = {r.numbers.numel() for r in todo}
        if len(widths) == 1:  # one stack (the steps of a run have the same MTP depths)
            for r, row in zip(todo, torch.stack([r.numbers for r in todo]).tolist()):
                r._host = row
        for r in todo:
            r.host()

    def host(self) -> list[float]:
        if self._host is None:
            self._host = self.numbers.tolist()
        return self._host

    @property
    def loss(self) -> float:  # mean CE over the global batch's tokens, identical on every rank
        return self.host()[0]

    @property
    def grad_norm(self) -> float:  # global gradient norm before clipping, identical on every rank
        return self.host()[1]

    @property
    def tokens(self) -> int:  # non-ignored tokens of the global batch
        return int(self.host()[2])

    @property
    def skipped(self) -> bool:  # True when loss or grad norm was not finite (or the step not committed): no update
        return not self.committed or bool(self.host()[3])

    @property
    def mtp(self) -> list[float] | None:  # a model with MTP depths: each depth's loss over the global batch's tokens
        return self.host()[4:] or None


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
    norm = torch.as_tensor(clip_fn(params, max_norm), dtype=torch.float64, device=total.device)
    skipped = (~(torch.isfinite(total) & torch.isfinite(norm))).to(torch.float64)  # decided on the device
    numbers = torch.cat([torch.stack([total, norm, tokens.to(torch.float64).reshape(()), skipped]), mtp])
    lr = float(optimizer.param_groups[0]["lr"])  # the rate this update uses (the scheduler moves it on below)
    if replicas is not None and not replicas.should_commit():
        return StepResult(numbers, committed=False, lr=lr)
    _update(optimizer, lr_scheduler, skipped)
    moe_stats = moe.end_step(skipped) if moe is not None else None
    return StepResult(numbers, moe=moe_stats, lr=lr)


def _check_loss(loss) -> None:
    """``train_step``'s loss must divide by the global token count it sets: a :class:`ScaledLoss`, else one line."""
    if not isinstance(loss, ScaledLoss):
        raise TypeError(
            f"train_step: loss must be a ScaledLoss (it divides the summed loss by the global token count, which "
            f"train_step sets as loss.denominator every step), got {type(loss).__name__}; pass "
            f"ScaledLoss(loss_fn) with loss_fn(output, labels) returning the SUM over tokens (from titanlike.parallel "
            f"import ScaledLoss), or the .loss of build_parallel_model / pipeline_module"
        )


def _update(optimizer: torch.optim.Optimizer, lr_scheduler, skipped: torch.Tensor) -> None:
    """The optimizer step, a no-op on the device when ``skipped`` (1.0: the loss or the norm was not finite), and
    the LR schedule's step (always: the learning rate follows the step number, which counts skipped steps too)."""
    skip_on_device(optimizer, skipped)
    if lr_scheduler is not None:
        # A skipped first update on a CPU calls no optimizer.step() (the flag is read there): torch then warns that
        # the scheduler stepped before the optimizer; that order is intended (the rate follows the step number).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            lr_scheduler.step()


def skip_on_device(optimizer: torch.optim.Optimizer, skipped: torch.Tensor) -> None:
    """``optimizer.step()`` that leaves every weight and every optimizer state (AdamW's moments and ``step``, Muon's
    momentum) exactly as they were when the device flag ``skipped`` is 1, without reading it on the host: fused
    Adam / AdamW take it as their ``found_inf`` (as ``torch.amp.GradScaler`` passes it: the kernel skips the update
    and takes the step count back); any other optimizer on an accelerator steps and then has what it changed put
    back with ``torch.where`` from a copy taken before (the parameters and their state copied every step into buffers
    kept between steps: one more copy of them in memory; state the step created goes back to zeros, its initial value,
    AdamW's and Muon's). On a CPU, where a host read stalls nothing, such an optimizer reads the flag instead (one
    read per step; :data:`COPY_ON_CPU` takes the copy path there too)."""
    if _takes_found_inf(optimizer):
        optimizer.grad_scale, optimizer.found_inf = None, skipped.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        return
    if skipped.device.type == "cpu" and not COPY_ON_CPU:
        # On a CPU the host read stalls no queue, and the copy cost a sixth of a 20-step debug run (foreach AdamW):
        # the flag is read and the step taken or not, as a host-side skip does.
        if not bool(skipped):
            optimizer.step()
        return
    tensors = _updated_tensors(optimizer)
    before = _copy_buffers(optimizer, tensors)
    torch._foreach_copy_(before, tensors)
    optimizer.step()
    restore_where(skipped, tensors, before)
    for t in _updated_tensors(optimizer)[len(tensors) :]:  # state created by this step: its zeros when skipped
        restore_where(skipped, [t], [torch.zeros_like(t)])


COPY_ON_CPU = False  # the copy-and-restore skip for parameters on a CPU too (the tests of that path set it)


def _copy_buffers(optimizer, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers ``skip_on_device`` copies ``tensors`` into, kept on the optimizer from step to step (allocating
    them every step cost a third more on a CPU); new ones when the tensors changed (the first step's new state)."""
    key = tuple(id(t) for t in tensors)
    cached = getattr(optimizer, "_skip_copy", None)
    if cached is None or cached[0] != key:
        cached = optimizer._skip_copy = (key, [torch.empty_like(t) for t in tensors])
    return cached[1]


def _takes_found_inf(optimizer) -> bool:
    """Fused Adam / AdamW (the default on CUDA): the kernel skips on ``found_inf``, DTensor parameters too (a plain
    scalar flag, the same on every rank)."""
    groups = optimizer.param_groups
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(g.get("fused") for g in groups)


@torch.no_grad()  # a DTensor's own local tensor (the same object every step: _copy_buffers keys by it)
def _updated_tensors(optimizer) -> list[torch.Tensor]:
    """The local tensors an optimizer step may change: each parameter with a gradient, then its state tensors (new
    state last: the order is stable across the step)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    state = [
        local_tensor(v) for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)
    ]
    return [local_tensor(p.detach()) for p in params] + state


@torch.no_grad()
def restore_where(skipped: torch.Tensor, tensors: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> None:
    """Each of ``tensors`` back to its ``before`` where the device flag ``skipped`` is set (no host read)."""
    flags: dict[torch.device, torch.Tensor] = {}
    for t, b in zip(tensors, before):
        flag = flags.get(t.device)
        if flag is None:
            flag = flags[t.device] = skipped.to(device=t.device, dtype=torch.bool)
        torch.where(flag, b, t, out=t)


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
