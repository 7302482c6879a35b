"""Pipeline parallelism: split the plain model into stages and run them with a torch.distributed.pipelining schedule.

The pieces, in the order :func:`apply_pp` uses them:

* **Split** (``titanlike.layout.stage_module_names``): stage ``s`` holds a contiguous slice of ``layers.*``; the
  first stage also the embedding, the last the final norm and the output head (and computes the loss).
* **Place** (``titanlike.layout.stage_ids_for_rank``): loop style for single-stage and interleaved schedules (pp
  rank ``r`` holds stages ``r, r + pp, r + 2pp, ...``), V style for the schedules whose own stage map is a V
  (ZBVZeroBubble, DualPipeV: rank ``r`` holds ``r`` and ``2pp - 1 - r``, so rank 0 holds the first and last stage).
* **Build** (:func:`build_stage_module`): the model's own partial constructor on the meta device, then storage on
  the target device filled from the full model's state dict by name: the stage keeps the plain model's FQNs.
* **Parallelize** each stage module with ``parallelize_model`` over the non-pp mesh dims (TP, AC, compile, FSDP).
  FSDP keeps parameters unsharded between forward and backward under PP (``titanlike.layout.reshard_after_forward``):
  the zero-bubble schedules run the weight-gradient half of the backward outside FSDP's hooks, and resharding after
  forward gives wrong or missing gradients there (docs/facts.md, "The zero-bubble resharding trap"); it also
  saves one all-gather per microbatch, which is the point of keeping a few stages resident.
* **Schedule** by name, ``local_batch_size / pipeline_parallel_microbatch_size`` microbatches, the trainer's
  :class:`ScaledLoss` (``sum(CE) / global_tokens``) as the last stage's loss and ``scale_grads=False``: torch's
  default divides the accumulated gradients by the number of microbatches, which is right for a per-microbatch
  *mean* loss and wrong for ours, whose microbatch losses already add up to the batch's share of the global mean.

**Tied parameters across stages.** A parameter the full model reaches under several names (``output.weight is
tok_embeddings.weight``, or any other tie), found by identity, not by the spec's names, whose names lie on
different stages, gets one copy per stage holding it (equal initial values, both from the full model), and
:meth:`PipelineParallel.finalize_grads` sums the copies' gradients after the backward between exactly the ranks that
hold them (the pp group when every pp rank does, else a group of just those ranks; a local add for copies on one
rank, as under V placement, where rank 0 holds the first and last stage). Equal gradients, equal AdamW states: the
copies stay bitwise equal. Under FSDP / TP the gradient is a DTensor with the same placements on every copy (checked
at build time), so the local shards are summed. The gradient norm counts the parameter once. The same mechanism
(:func:`_tied_across_stages`) serves :func:`apply_pp` and :func:`pipeline_module`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from titanlike.errors import ConfigError
from titanlike.layout import (
    SCHEDULES,
    precision_policy,
    schedule_class,
    schedule_facts,
    stage_ids_for_rank,
    stage_module_names,
)
from titanlike.loss import ScaledLoss
from titanlike.models.spec import spec_for
from titanlike.parallel import clip
from titanlike.parallel.materialize import materialize, to_empty_keeping_ties
from titanlike.parallel.parallelize import build_loss_fn, parallelize_model

__all__ = [
    "PipelineParallel",
    "apply_pp",
    "build_stage_from_fqns",
    "build_stage_module",
    "check_split",
    "pipeline_module",
]


# ---------------------------------------------------------------------------------------------------- the build
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_stage_module(full_model: nn.Module, names: Iterable[str], device: torch.device) -> nn.Module:
    """The stage holding ``names``, built by the model's partial constructor, with the full model's FQNs.

    A full model on the meta device (the trainer's way) gives the stage on the meta device: it is parallelized
    there and then allocated and filled by :func:`~titanlike.parallel.materialize.materialize` (sharded init, or a
    checkpoint load), so no rank ever holds a whole stage. A materialised full model gives a stage on ``device``
    filled by FQN with *copies* of its values (never shared storage: two stages of a rank must not alias a tied
    weight, or the optimizer would update it twice); a stage holding both the embedding and the head keeps them
    tied as the constructor made them. Buffers (RoPE tables) are copied as they are.
    """
    names = list(names)
    spec = spec_for(full_model)
    if spec is None:
        raise ValueError(
            f"build_stage_module: {type(full_model).__name__} is not a registered model; register a "
            f"ModelSpec for it (docs/adding_a_model.md)"
        )
    dtype = next(full_model.parameters()).dtype
    with torch.device("meta"), _default_dtype(dtype):
        stage = spec.build(full_model.args, **spec.stage_kwargs(names))
    full_buffers = dict(full_model.named_buffers())
    if next(full_model.parameters()).is_meta:
        for name, b in list(stage.named_buffers()):  # the full model's buffer dtypes (float64 RoPE tables)
            prefix, _, leaf = name.rpartition(".")
            stage.get_submodule(prefix)._buffers[leaf] = b.to(full_buffers[name].dtype)
        return stage
    to_empty_keeping_ties(stage, device)
    full_sd = full_model.state_dict()
    stage.load_state_dict({k: full_sd[k] for k in stage.state_dict()}, strict=True)
    for name, _ in list(stage.named_buffers()):
        prefix, _, leaf = name.rpartition(".")
        stage.get_submodule(prefix)._buffers[leaf] = full_buffers[name].detach().clone().to(device)
    return stage


# ---------------------------------------------------------------------------------------------------- the runtime
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
        pp = dist.get_world_size(self.pp_group)
        v = schedule_facts(self.schedule_name).v_placement
        pp_rank = (stage if stage < pp else 2 * pp - 1 - stage) if v else stage % pp
        return dist.get_process_group_ranks(self.pp_group)[pp_rank]

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the cross entropy over ``labels``, the same float64 scalar on every pp rank. Forward only.

        Torch's ``schedule.eval`` replays the training action list and fails for the V schedules, so this runs
        its own forward pass, independent of the schedule: microbatch by microbatch, stage by stage in global
        order, with blocking send / recv of the hidden states (their local tensors, which the next stage's
        parallel plan accepts like the schedule's). Every rank's sequence of (microbatch, stage) is ordered like
        the global one and only depends on earlier pairs, so the blocking P2P cannot deadlock.
        """
        device = inputs.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        modules = dict(zip(self.stage_ids, self.model_parts))
        last = self.num_stages - 1
        carry = None  # the previous stage's output when this rank holds both stages
        for x, y in zip(inputs.split(self.microbatch_size), labels.split(self.microbatch_size)):
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
                out = modules[s](h)
                if s == last:
                    loss = self.loss.loss_fn(out, y)
                    total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).to(torch.float64)
                elif s + 1 in modules:
                    carry = out
                else:
                    out = _local(out).contiguous()
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
            grads = [_local(p.grad) for p in params]
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


def _holds(stage: nn.Module, names: Sequence[str]) -> bool:
    return any(getattr(stage, n, None) is not None for n in names)


def _plain_tensors_between_stages(stage: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Under TP the residual stream is a DTensor (``Shard(1)`` under SP, else ``Replicate()``); between stages it
    travels as its plain local tensor, like the data into the first stage: a stage without the embedding turns
    its input back into the DTensor, one without the head returns the local tensor. (The P2P of torch's stages
    then moves ordinary tensors, as in every supported torch version.)"""
    seq = Shard(1) if sequence_parallel else Replicate()
    spec = spec_for(stage)
    if not _holds(stage, spec.input_modules):
        parallelize_module(
            stage,
            tp_mesh,
            PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=False),
        )
    if not _holds(stage, spec.output_modules):
        stage.register_forward_hook(_local_copy)


def _local_copy(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The stage output's local tensor, as a new tensor: the zero-bubble schedules ``detach_()`` stage outputs
    after the input-gradient pass, which a view (what ``to_local`` returns) does not allow."""
    return output.to_local().clone() if isinstance(output, DTensor) else output


def _shared_parameters(
    model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]]
) -> list[tuple[list[str], list[int]]]:
    """Parameters of the full ``model`` reachable under several names (by identity, whatever the names) whose names
    lie on more than one stage: (their names, the stages holding one of them)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    shared = []
    for names in by_id.values():
        holders = sorted(
            {s for s, fqns in enumerate(module_fqns_per_stage) for n in names if _module_owner(model, fqns, n)}
        )
        if len(holders) > 1:
            shared.append((names, holders))
    return shared


def _check_tied_layout(names: list[str], mine: list[nn.Parameter], group) -> None:
    """All copies of a tied parameter must have the same placements and local shape, or summing local shards
    would be wrong."""

    def layout(p):
        return (tuple(map(str, p.placements)) if isinstance(p, DTensor) else None, tuple(_local(p).shape))

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
    None when this rank holds them all, the pp group when every pp rank does, else a group made by its members),
    and the ids of the copies left out of the gradient norm (all but the lowest stage's)."""
    ranks = dist.get_process_group_ranks(pp_group)
    pp = len(ranks)
    v = schedule_facts(schedule).v_placement

    def pp_rank_of(stage: int) -> int:
        return (stage if stage < pp else 2 * pp - 1 - stage) if v else stage % pp

    tied_sets, excluded = [], set()
    for names, holders in _shared_parameters(model, module_fqns_per_stage):
        mine = []
        for m, s in zip(parts, stage_ids):
            if s in holders:
                p = m.get_parameter(next(n for n in names if _module_owner(model, module_fqns_per_stage[s], n)))
                mine.append(p)
                if s != holders[0]:
                    excluded.add(id(p))
        holder_ranks = sorted({ranks[pp_rank_of(s)] for s in holders})
        if not mine:
            continue
        if len(holder_ranks) == 1:
            group = None
        elif len(holder_ranks) == pp:
            group = pp_group
        else:
            group = dist.new_group(holder_ranks, use_local_synchronization=True)
        _check_tied_layout(names, mine, group)
        tied_sets.append((mine, group))
    return tied_sets, excluded


def apply_pp(
    model: nn.Module, dims, mesh, cfg, device: torch.device, *, init_seed: int | None = None
) -> PipelineParallel:
    """Split the full ``model`` into this rank's stages, parallelize them, build the schedule.

    ``model`` on the meta device: the stages are built and parallelized on meta, then only this rank's shards are
    allocated and filled by the sharded init from ``init_seed`` (None: left for a checkpoint load). A materialised
    ``model``: each stage copies its values."""
    p = cfg.parallelism
    schedule_name = p.pipeline_parallel_schedule
    pp_mesh = mesh["pp"]
    pp_group, pp_rank, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
    names = stage_module_names(cfg, model.args)
    n_stages = len(names)
    stage_ids = stage_ids_for_rank(pp_rank, pp, n_stages, schedule_name)

    parts = [build_stage_module(model, names[s], device) for s in stage_ids]
    if dims.tp_enabled:
        for m in parts:
            _plain_tensors_between_stages(m, mesh["tp"], p.enable_sequence_parallel)
    parts = [parallelize_model(m, dims, mesh, cfg) for m in parts]
    if next(model.parameters()).is_meta:
        for m in parts:
            materialize(m, device, init_seed)
    if precision_policy(cfg.training.dtype, dims) == "autocast":
        # bf16 without FSDP's mixed precision is autocast over float32 weights. The schedule interleaves forwards
        # and backwards, so the trainer cannot wrap the forward alone: each stage's forward enters autocast.
        for m in parts:
            m.forward = torch.autocast(device.type, dtype=torch.bfloat16)(m.forward)
    stages = [PipelineStage(m, s, n_stages, device, group=pp_group) for m, s in zip(parts, stage_ids)]

    loss = ScaledLoss(build_loss_fn(cfg, dims, mesh))
    n_microbatches = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
    cls = schedule_class(schedule_name)
    single = schedule_facts(schedule_name).single_stage
    if single and len(stages) != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule_name} runs one stage per rank, "
            f"the split gives {len(stages)}"
        )
    schedule = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)

    # After parallelize (FSDP / TP have replaced the parameters by DTensors): the full model's ties, by identity.
    tied_sets, excluded = _tied_across_stages(model, names, parts, stage_ids, pp_group, schedule_name)
    return PipelineParallel(
        model_parts=parts,
        stages=stages,
        stage_ids=stage_ids,
        num_stages=n_stages,
        schedule=schedule,
        loss=loss,
        pp_group=pp_group,
        has_first_stage=0 in stage_ids,
        has_last_stage=n_stages - 1 in stage_ids,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        schedule_name=schedule_name,
        tied_sets=tied_sets,
        norm_excluded=excluded,
    )


# ---------------------------------------------------------------------------------------------------- any module
def _module_owner(model: nn.Module, fqns: Sequence[str], name: str) -> str | None:
    """The listed module FQN that holds parameter ``name`` (a prefix of it), or None."""
    for fqn in fqns:
        if name == fqn or name.startswith(fqn + "."):
            return fqn
    return None


def check_split(model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]]) -> None:
    """Every listed FQN is a module of ``model``, listed once; every parameter lies in exactly one listed module
    (under one of its names: tied parameters may be listed on several stages). Raises ValueError naming them all."""
    problems = []
    modules = dict(model.named_modules())
    flat = [f for stage in module_fqns_per_stage for f in stage]
    if len(module_fqns_per_stage) < 2 or any(not stage for stage in module_fqns_per_stage):
        problems.append("give at least 2 stages, none of them empty")
    unknown = [f for f in flat if f not in modules or f == ""]
    if unknown:
        problems.append(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a submodule of {type(model).__name__}"
        )
    twice = sorted({f for f in flat if flat.count(f) > 1})
    if twice:
        problems.append(f"{', '.join(twice)} listed more than once")
    nested = sorted({a for a in flat for b in flat if a != b and a.startswith(b + ".")})
    if nested:
        problems.append(f"{', '.join(nested)} inside another listed module")
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    orphans = [names[0] for names in by_id.values() if not any(_module_owner(model, flat, n) for n in names)]
    if orphans:
        problems.append(f"parameter(s) {', '.join(orphans[:6])} in no listed module")
    if problems:
        raise ValueError(
            f"pipeline split of {type(model).__name__}: " + "; ".join(problems) + "; list module FQNs "
            "(model.named_modules()) per stage so that every parameter is in exactly one"
        )


def build_stage_from_fqns(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """A copy of ``model`` holding only the modules ``fqns`` (torchtitan's module_fqns_per_model_part): other
    children are set to None, other entries of a ModuleDict / ModuleList are deleted (their keys, hence the FQNs,
    are kept). The model's forward must skip None modules and take hidden states when its input modules are None
    (the contract torchtitan's models follow). Parameter names are the full model's.

    Only what the stage keeps is copied (one ``deepcopy`` whose memo maps every dropped module to None), not the
    whole model per stage: a stage of a large model costs its own share of the memory."""
    keep = set(fqns)
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = {id(m) for fqn in keep for m in modules[fqn].modules()}
    memo: dict = {}
    dropped: list[tuple[str, str]] = []  # (owner FQN, child name)

    def drop(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in keep:
                continue
            if any(k.startswith(fqn + ".") for k in keep):
                drop(child, fqn + ".")
            else:
                dropped.append((prefix[:-1], name))
                if id(child) not in kept:  # (a module also reachable under a kept name is copied, once)
                    memo[id(child)] = None  # deepcopy puts None there instead of copying it

    drop(model, "")
    stage = copy.deepcopy(model, memo)
    for owner_fqn, name in dropped:
        owner = stage.get_submodule(owner_fqn)
        if isinstance(owner, (nn.ModuleDict, nn.ModuleList)):
            del owner._modules[name]  # the other keys (FQNs) stay as they are
        else:
            setattr(owner, name, None)
    return stage


def pipeline_module(
    model: nn.Module,
    pp_mesh,
    module_fqns_per_stage: Sequence[Sequence[str]],
    *,
    loss_fn,
    n_microbatches: int,
    schedule: str = "1F1B",
    device: torch.device | str = "cpu",
    parallelize_stage=None,
) -> PipelineParallel:
    """Pipeline-parallelize any module: stages from a user's split (module FQNs per stage), this rank's stages
    built and run by the ``schedule`` (any of :data:`SCHEDULES`; loop placement, V placement for the V schedules).

    ``loss_fn(output, labels)`` returns the SUM of the loss over the microbatch (the trainer's ScaledLoss divides by
    the global token count); ``parallelize_stage(module, is_first, is_last)`` applies TP / FSDP to each stage module
    and returns it (optional). Parameters shared by identity across stages (tied embeddings) keep one copy per
    stage; :meth:`PipelineParallel.finalize_grads` sums their gradients between exactly the ranks holding a copy
    (call it through ``finalize_grads_and_clip_`` as the clip function). Returns a :class:`PipelineParallel`.
    """
    check_split(model, module_fqns_per_stage)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{schedule}'; valid: {', '.join(SCHEDULES)}")
    device = torch.device(device)
    pp_group, pp_rank, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
    n_stages = len(module_fqns_per_stage)
    stage_ids = stage_ids_for_rank(pp_rank, pp, n_stages, schedule)
    parts = []
    for s in stage_ids:
        m = build_stage_from_fqns(model, module_fqns_per_stage[s]).to(device)
        first, last = s == 0, s == n_stages - 1
        if parallelize_stage is not None:
            m = parallelize_stage(m, first, last)
        if not last:
            m.register_forward_hook(_local_copy)
        parts.append(m)
    stages = [PipelineStage(m, s, n_stages, device, group=pp_group) for m, s in zip(parts, stage_ids)]
    loss = ScaledLoss(loss_fn)
    cls = schedule_class(schedule)
    facts = schedule_facts(schedule)
    single = facts.single_stage
    if single and len(stages) != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, the split gives {len(stages)} on this rank")
    sched = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
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
