"""The pipeline runtime: this rank's stages run by a torch.distributed.pipelining schedule, the eval executor, and
the gradient sync of parameters tied across stages.

* **Schedule**: one builder (:func:`make_pipeline`) for every caller: the trainer's stage modules and a user's,
  ``n_microbatches`` microbatches, a :class:`ScaledLoss` (``sum(CE) / global_tokens``) as the last stage's loss and
  ``scale_grads=False``: torch's default divides the accumulated gradients by the number of microbatches, which is
  right for a per-microbatch *mean* loss and wrong for ours, whose microbatch losses already add up to the batch's
  share of the global mean.
* **Between stages** every output but the last stage's travels as a plain tensor (:func:`local_copy`): the local
  tensor of a DTensor residual stream under TP, as a new tensor (the zero-bubble schedules ``detach_()`` stage
  outputs, which a view does not allow).
* **Eval** (:meth:`PipelineParallel.eval_loss`): a forward-only executor of its own (torch's ``schedule.eval``
  replays the training actions and fails for the V schedules).

**Tied parameters across stages.** A parameter the full model reaches under several names (``output.weight is
tok_embeddings.weight``, or any other tie), found by identity (``titanlike.parallel.ties``), whose names lie on
different stages, gets one copy per stage holding it (equal initial values, both from the full model), and
:meth:`PipelineParallel.finalize_grads` sums the copies' gradients after the backward between exactly the ranks that
hold them (the pp group when every pp rank does, else a group of just those ranks; a local add for copies on one
rank, as under V placement, where rank 0 holds the first and last stage). Equal gradients, equal AdamW states: the
copies stay bitwise equal. Under FSDP / TP the gradient is a DTensor with the same placements on every copy (checked
at build time), so the local shards are summed. The gradient norm counts the parameter once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from titanlike.layout import SCHEDULES, rank_of_stage, schedule_class, schedule_facts, stage_ids_for_rank
from titanlike.loss import ScaledLoss, recording_paused
from titanlike.models.moe import stats_paused
from titanlike.parallel import clip
from titanlike.parallel.pipeline.build import build_stage, module_owner
from titanlike.parallel.replica_check import checks_paused
from titanlike.parallel.ties import parameter_names
from titanlike.sharding import local_tensor

__all__ = ["PipelineParallel", "local_copy", "make_pipeline"]


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose metadata inference leaves the model's training statistics alone: torch runs each
    stage's forward (and, from 2.13, backward) once at the first step to learn the shapes (2.13: on empty tensors,
    ``_forward_metadata_inference``; earlier: ``_shape_inference``), which an MoE block would count as routed tokens
    of the step (wrong expert loads and bias update; caught by the pipeline gate's MoE layouts), and which the
    replica check would compare across tp ranks (``torch.empty`` rows differ: a false refusal, seen on nanoGPT's
    second stage under tp2)."""


def _not_a_training_forward(method: Callable) -> Callable:
    def paused(self, *args, **kwargs):
        with stats_paused(), checks_paused(), recording_paused():
            return method(self, *args, **kwargs)

    return paused


for _name in ("_forward_metadata_inference", "_shape_inference"):
    if hasattr(PipelineStage, _name):
        setattr(_Stage, _name, _not_a_training_forward(getattr(PipelineStage, _name)))


def _not_a_training_loss(method: Callable) -> Callable:
    def paused(self, *args, **kwargs):
        with recording_paused():
            return method(self, *args, **kwargs)

    return paused


def _init_ops_without_self(self) -> list:
    """torch's warm-up p2p ops of the stage's neighbours, less those with this rank itself: a V schedule
    (ZBVZeroBubble) holds two neighbouring stages on one rank, and torch 2.11's batched warm-up then sends to its own
    rank, which gloo refuses ("Pair is not connected"); neighbours on one rank exchange tensors without p2p."""
    me = dist.get_rank(self.group)
    return [op for op in PipelineStage._get_init_p2p_neighbors_ops(self) if op.group_peer != me]


if hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
    _Stage._get_init_p2p_neighbors_ops = _init_ops_without_self


# torch 2.13's backward metadata inference calls the loss function on the last stage's real-shaped outputs: not a
# loss of the step (the MTP depth losses would count one microbatch twice at the first step)
if hasattr(PipelineStage, "_backward_metadata_inference"):
    _Stage._backward_metadata_inference = _not_a_training_loss(PipelineStage._backward_metadata_inference)


@dataclass
class PipelineParallel:
    """What :func:`apply_pp` returns: this rank's stages and the schedule that runs them."""

    model_parts: list[nn.Module]  # this rank's stage modules, in stage order
    stages: list[PipelineStage]
    stage_ids: list[int]
    num_stages: int
    schedule: object  # a torch.distributed.pipelining schedule
    loss: ScaledLoss  # the last stage's loss_fn (the trainer sets its denominator every step)
    pp_group: dist.ProcessGroup
    has_first_stage: bool
    has_last_stage: bool
    microbatch_size: int
    schedule_name: str
    # Every parameter of the full model shared by identity across stages (tied embeddings, or any other tie), as
    # (this rank's copies, the group of the ranks holding a copy or None when this rank holds all of them), and the
    # ids of the copies left out of the gradient norm (all but the one of the lowest stage): _tied_across_stages.
    tied_sets: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]] = field(default_factory=list)
    norm_excluded: set[int] = field(default_factory=set)

    def stage_rank(self, stage: int) -> int:
        """Global rank of the member of this rank's pipeline that holds ``stage``."""
        pp_rank = rank_of_stage(stage, dist.get_world_size(self.pp_group), self.schedule_name)
        return dist.get_process_group_ranks(self.pp_group)[pp_rank]

    @torch.no_grad()
    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_starts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum of the cross entropy over ``labels``, the same float64 scalar on every pp rank. Forward only.

        Torch's ``schedule.eval`` replays the training action list and fails for the V schedules, so this runs
        its own forward pass, independent of the schedule: microbatch by microbatch, stage by stage in global
        order, with blocking send / recv of the hidden states (their local tensors, which the next stage's
        parallel plan accepts like the schedule's). Every rank's sequence of (microbatch, stage) is ordered like
        the global one and only depends on earlier pairs, so the blocking P2P cannot deadlock. The stages run in
        eval mode (an MoE block counts its expert loads and aux loss in training only), then train again.
        """
        modes = [m.training for m in self.model_parts]
        for m in self.model_parts:
            m.eval()
        try:
            return self._eval_loss(inputs, labels, document_starts)
        finally:
            for m, mode in zip(self.model_parts, modes):
                m.train(mode)

    def _eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_starts: torch.Tensor | None
    ) -> torch.Tensor:
        device = inputs.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        modules = dict(zip(self.stage_ids, self.model_parts))
        last = self.num_stages - 1
        carry = None  # the previous stage's output when this rank holds both stages
        n = self.microbatch_size
        starts = [None] * len(inputs.split(n)) if document_starts is None else document_starts.split(n)
        for x, y, st in zip(inputs.split(n), labels.split(n), starts):
            kwargs = {} if st is None else {"document_starts": st}  # the block-causal mask, as in training
            for s in self.stage_ids:
                if s == 0:
                    h = x
                elif s - 1 in modules:
                    h = carry
                else:
                    meta: list = [None]
                    dist.recv_object_list(meta, src=self.stage_rank(s - 1), group=self.pp_group, device=device)
                    h = torch.empty(meta[0][0], dtype=meta[0][1], device=device)
                    dist.recv(h, src=self.stage_rank(s - 1), group=self.pp_group)
                out = modules[s](h, **kwargs)
                if s == last:
                    loss = self.loss.loss_fn(out, y)
                    total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).to(torch.float64)
                elif s + 1 in modules:
                    carry = out
                else:
                    out = local_tensor(out).contiguous()
                    dist.send_object_list(
                        [(tuple(out.shape), out.dtype)], dst=self.stage_rank(s + 1), group=self.pp_group, device=device
                    )
                    dist.send(out, dst=self.stage_rank(s + 1), group=self.pp_group)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage contributed
        # FSDP groups that keep their parameters after forward (all of them under PP) would stay unsharded: the
        # modules would hold the gathered copies, not the sharded parameters the optimizer and checkpoints see.
        for part in self.model_parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        return total

    @torch.no_grad()
    def finalize_grads(self) -> None:
        """Sum the gradients of each tied parameter over its copies (between exactly the ranks holding one; a local
        add for copies on this rank). Call once per optimizer step, after the last backward (and before the
        gradient norm): :meth:`finalize_grads_and_clip_` does."""
        for params, group in self.tied_sets:
            for p in params:
                if p.grad is None:  # this copy's stage did not use it: the other copies' gradients still count
                    p.grad = torch.zeros_like(p)
            grads = [local_tensor(p.grad) for p in params]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)

    def finalize_grads_and_clip_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The trainer's ``clip_fn`` under PP: :meth:`finalize_grads`, then the global gradient norm over all
        stages (pp group) and the non-pp mesh dims, counting the tied weight once, then clipping (``max_norm > 0``).
        """
        self.finalize_grads()
        params = list(parameters)
        return clip.clip_grad_norm_(
            params,
            max_norm,
            pp_group=self.pp_group,
            norm_parameters=[p for p in params if id(p) not in self.norm_excluded],
        )


def local_copy(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The stage output's local tensor, as a new tensor: the zero-bubble schedules ``detach_()`` stage outputs
    after the input-gradient pass, which a view (what ``to_local`` returns) does not allow."""
    return output.to_local().clone() if isinstance(output, DTensor) else output


def _shared_parameters(
    model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]]
) -> list[tuple[list[str], list[int]]]:
    """Parameters of the full ``model`` (by identity, under any of their names) that lie on more than one stage: a
    tie whose names are on different stages, or a module listed on several stages (``pipeline_module``'s
    ``shared``): (their names, the stages holding one of them)."""
    shared = []
    for names in parameter_names(model):
        holders = sorted({s for s, fqns in enumerate(module_fqns_per_stage) for n in names if module_owner(fqns, n)})
        if len(holders) > 1:
            shared.append((names, holders))
    return shared


def _check_tied_layout(names: list[str], mine: list[nn.Parameter], group) -> None:
    """All copies of a tied parameter must have the same placements and local shape, or summing local shards
    would be wrong."""

    def layout(p):
        return (tuple(map(str, p.placements)) if isinstance(p, DTensor) else None, tuple(local_tensor(p).shape))

    seen = [layout(p) for p in mine]
    if group is not None:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, seen[0], group=group)
        seen += gathered
    if any(o != seen[0] for o in seen):
        raise RuntimeError(
            f"tied parameter {' = '.join(names)}: its copies on different pipeline stages are sharded "
            f"differently ({sorted(set(seen))}); give the modules holding it the same TP / FSDP layout"
        )


def _holders_group(holder_ranks: list[int]) -> dist.ProcessGroup | None:
    """The group of the ranks holding copies of a tied parameter (some of the pp group's), made by every rank of the
    job: each brings its own pp group's holders, and all make every pp group's in the same order. torch 2.15 names a
    group after a count of the groups each rank made before: one made by its members alone
    (``use_local_synchronization``) left the other ranks' count behind, and the next group of the job hung."""
    sets: list = [None] * dist.get_world_size()
    dist.all_gather_object(sets, holder_ranks)
    mine = None
    for ranks in sorted({tuple(r) for r in sets}):
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _tied_across_stages(
    model: nn.Module,
    module_fqns_per_stage: Sequence[Sequence[str]],
    parts: Sequence[nn.Module],
    stage_ids: Sequence[int],
    pp_group: dist.ProcessGroup,
    schedule: str,
):
    """After parallelize, for :class:`PipelineParallel`: every parameter the full ``model`` shares by identity
    between stages (each stage holds its own copy), as (this rank's copies, the group of the ranks holding a copy:
    None when this rank holds them all, the pp group when every pp rank does, else :func:`_holders_group`),
    and the ids of the copies left out of the gradient norm (all but the lowest stage's)."""
    ranks = dist.get_process_group_ranks(pp_group)
    pp = len(ranks)
    tied_sets, excluded = [], set()
    for names, holders in _shared_parameters(model, module_fqns_per_stage):
        mine = []
        for m, s in zip(parts, stage_ids):
            if s in holders:
                p = m.get_parameter(next(n for n in names if module_owner(module_fqns_per_stage[s], n)))
                mine.append(p)
                if s != holders[0]:
                    excluded.add(id(p))
        holder_ranks = sorted({ranks[rank_of_stage(s, pp, schedule)] for s in holders})
        if len(holder_ranks) == 1:
            group = None
        elif len(holder_ranks) == pp:
            group = pp_group
        else:
            group = _holders_group(holder_ranks)
        if not mine:
            continue
        _check_tied_layout(names, mine, group)
        tied_sets.append((mine, group))
    return tied_sets, excluded


def _plain_step_inputs(sched, has_first_stage: bool) -> None:
    """``sched.step(inputs, ...)`` takes the inputs as torch 2.11's stages check them (2.13 accepts any): contiguous
    (2.11 compares each microbatch's strides with the shape inference's, a slice ``tokens[:, :-1]`` fails), and only
    on the rank holding the first stage (2.11: "Can't supply input args for shape inference on non-first stage").
    Every caller (train_step, the examples) may then pass the same arguments on every rank."""
    step = sched.step

    def plain_step(*args, **kwargs):
        if not has_first_stage:
            return step(**kwargs)
        return step(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)

    sched.step = plain_step


def make_pipeline(
    model: nn.Module,
    pp_mesh,
    module_fqns_per_stage: Sequence[Sequence[str]],
    *,
    loss_fn: Callable,
    n_microbatches: int,
    schedule: str,
    device: torch.device,
    parallelize_stage: Callable[[nn.Module, bool, bool], nn.Module] | None = None,
) -> PipelineParallel:
    """This rank's stages of ``model`` (:func:`~titanlike.parallel.pipeline.build.build_stage`: on meta they stay
    there, a materialised model's are moved to ``device``), each through ``parallelize_stage(module, is_first,
    is_last)``, the outputs of all but the last stage made plain tensors, the ``schedule`` over them and the tied
    parameters' gradient sync. The one place a schedule is built."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{schedule}'; valid: {', '.join(SCHEDULES)}")
    pp_group, pp_rank, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
    n_stages = len(module_fqns_per_stage)
    stage_ids = stage_ids_for_rank(pp_rank, pp, n_stages, schedule)
    single = schedule_facts(schedule).single_stage
    if single and len(stage_ids) != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, the split gives {len(stage_ids)} on this rank")
    on_meta = next(model.parameters()).is_meta
    parts = []
    for s in stage_ids:
        m = build_stage(model, module_fqns_per_stage[s])
        if not on_meta:
            m = m.to(device)
        first, last = s == 0, s == n_stages - 1
        if parallelize_stage is not None:
            m = parallelize_stage(m, first, last)
        if not last:
            m.register_forward_hook(local_copy)
        parts.append(m)
    stages = [_Stage(m, s, n_stages, device, group=pp_group) for m, s in zip(parts, stage_ids)]
    loss = ScaledLoss(loss_fn)
    cls = schedule_class(schedule)
    sched = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    _plain_step_inputs(sched, has_first_stage=0 in stage_ids)
    # After parallelize (FSDP / TP have replaced the parameters by DTensors): the full model's ties, by identity.
    tied_sets, excluded = _tied_across_stages(model, module_fqns_per_stage, parts, stage_ids, pp_group, schedule)
    return PipelineParallel(
        model_parts=parts,
        stages=stages,
        stage_ids=stage_ids,
        num_stages=n_stages,
        schedule=sched,
        loss=loss,
        pp_group=pp_group,
        has_first_stage=0 in stage_ids,
        has_last_stage=n_stages - 1 in stage_ids,
        microbatch_size=0,
        schedule_name=schedule,
        tied_sets=tied_sets,
        norm_excluded=excluded,
    )
