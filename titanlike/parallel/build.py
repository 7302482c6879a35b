"""The one builder of a parallelized model: what the trainer trains, the numerics gate checks and the benchmark
times, so the gate tests the exact code path users run.

``build_parallel_model(model, cfg, dims, device, init_seed=...)`` takes the plain single-device model, on the
meta device (the trainer's way: only this rank's shards are ever allocated, then filled by the sharded init from
``init_seed``, or left for a checkpoint load when ``init_seed`` is None) or materialised (the same weights on every
rank; each rank keeps its slices), and returns a :class:`ParallelModel`: this rank's model parts, the scaled loss,
the gradient-clipping function, the forward context (bf16 autocast when the layout's precision policy says so)
and, under pipeline parallelism, the :class:`~titanlike.parallel.pipeline.PipelineParallel` with its schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.layout import batch_split, canonical_microbatch_size, precision_policy, virtual_dp_degree
from titanlike.loss import ScaledLoss
from titanlike.models.moe import MoE, moe_modules
from titanlike.parallel.clip import clip_grad_norm_, plain_clip_grad_norm_
from titanlike.parallel.dims import ParallelDims
from titanlike.parallel.expert_parallel import ExpertBalancing, experts_modules
from titanlike.parallel.invariant import InvariantReduction
from titanlike.parallel.materialize import keeping_grad_hooks, materialize, to_empty_keeping_ties
from titanlike.parallel.parallelize import build_loss_fn, parallelize_model
from titanlike.parallel.pipeline import PipelineParallel, apply_pp

__all__ = ["ParallelModel", "build_parallel_model", "to_empty_keeping_ties"]


@dataclass
class ParallelModel:
    """This rank's share of the parallelized model and what a train step needs to run it."""

    model_parts: list[nn.Module]  # one module, or this rank's pipeline stages in stage order
    loss: ScaledLoss  # sum(CE) / denominator (the train step sets the global token count)
    clip_fn: Callable  # clip_fn(parameters, max_norm) -> global grad norm over every rank and stage
    forward_context: Callable[[], contextlib.AbstractContextManager]  # wraps forward + loss (not the backward)
    pp: PipelineParallel | None = None  # the stages and the schedule under pipeline parallelism
    # a model with MoE blocks: the aux-loss denominator before, the expert-bias update after each step (train_step)
    moe: ExpertBalancing | None = None
    # training.layout_invariant: the step's sums in the canonical tree (train_step's reduction; clip_fn is its norm)
    reduction: InvariantReduction | None = None

    @property
    def pp_schedule(self):
        return None if self.pp is None else self.pp.schedule

    @property
    def pp_group(self):
        return None if self.pp is None else self.pp.pp_group

    @property
    def has_last_stage(self) -> bool:
        return self.pp is None or self.pp.has_last_stage


def _null_context() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def mtp_loss(loss: ScaledLoss, model: nn.Module, cfg, dims: ParallelDims) -> ScaledLoss:
    """``loss`` set up for a model with MTP depths (``args.mtp_layers``): ``training.mtp_loss_weight``, the depth
    count, and under context parallelism the depths' labels shifted over the whole window."""
    loss.mtp_weight = cfg.training.mtp_loss_weight
    loss.mtp_depths = getattr(getattr(model, "args", None), "mtp_layers", 0) or 0
    if dims.cp_enabled and loss.mtp_depths:
        from titanlike.parallel.context_parallel import cp_shift_labels

        loss.shift_labels = cp_shift_labels(dims.get_mesh("cp"))
    return loss


def build_parallel_model(
    model: nn.Module, cfg, dims: ParallelDims, device: torch.device, *, init_seed: int | None = None
) -> ParallelModel:
    """Parallelize the plain ``model`` for the layout ``dims`` on its meshes (``dims.build_mesh`` first; one process:
    no mesh) and move it to ``device``.

    ``cfg`` is a ``titanlike.config.JobConfig``. A ``model`` on the meta device is parallelized there; then only
    this rank's shards are allocated and, with ``init_seed``, filled by the model's sharded init (the values of
    ``model.init_weights(seed=init_seed)`` on one device, under every layout); without it they are placeholders
    for a checkpoint load. Under pipeline parallelism ``model`` is the full model the stages are cut from
    (``apply_pp``); each bf16 stage enters autocast itself, because the schedule interleaves forwards and backwards.
    """
    if dims.pp_enabled:
        blocks = moe_modules(model)  # the whole model's MoE blocks, before the stages are cut from it
        layers = [n for n, m in model.named_modules() if isinstance(m, MoE)]
        pp = apply_pp(model, dims, cfg, device, init_seed=init_seed)
        mtp_loss(pp.loss, model, cfg, dims)
        moe = None
        if blocks:
            moe = ExpertBalancing(
                pp.model_parts,
                dims.expert_load_group(),
                dims.dp,
                layers=layers,
                num_experts=blocks[0].args.num_experts,
                pp_group=pp.pp_group,
            )
        reduction = invariant_reduction(pp.model_parts, cfg, dims, pp=pp)
        if reduction is not None and pp.tied_sets:
            raise ValueError("layout_invariant: parameters tied across pipeline stages are not invariant yet")
        return ParallelModel(
            model_parts=pp.model_parts,
            loss=pp.loss,
            clip_fn=pp.finalize_grads_and_clip_ if reduction is None else reduction.clip_grad_norm_,
            forward_context=_null_context,
            pp=pp,
            moe=moe,
            reduction=reduction,
        )
    on_meta = any(p.is_meta for p in model.parameters())
    model = parallelize_model(model, dims, cfg)
    loss = mtp_loss(ScaledLoss(build_loss_fn(cfg, dims)), model, cfg, dims)
    # FSDP's CPU offload: the sharded parameters stay in host memory, the buffers (RoPE tables) go to the device
    param_device = torch.device("cpu") if cfg.training.enable_cpu_offload else device
    if on_meta:
        materialize(model, device, init_seed, param_device=param_device)
    else:
        keeping_grad_hooks(model, lambda: model.to(param_device))
        if param_device != device:
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    setattr(module, name, buf.to(device))
    if precision_policy(cfg.training.dtype, dims, cfg.training.layout_invariant) == "autocast":

        def forward_context() -> contextlib.AbstractContextManager:
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        forward_context = _null_context
    clip_fn = clip_grad_norm_ if dims.built else plain_clip_grad_norm_
    moe = None
    if experts_modules(model):
        moe = ExpertBalancing([model], dims.expert_load_group() if dims.built else None, dims.dp)
    reduction = invariant_reduction(model, cfg, dims)
    if reduction is not None:
        clip_fn = reduction.clip_grad_norm_
    return ParallelModel(
        model_parts=[model], loss=loss, clip_fn=clip_fn, forward_context=forward_context, moe=moe, reduction=reduction
    )


def invariant_reduction(model_parts, cfg, dims: ParallelDims, pp=None) -> InvariantReduction | None:
    """The canonical tree of a layout-invariant run (``training.layout_invariant``; None otherwise): V virtual ranks
    of M canonical microbatches (``canonical_microbatch_size`` sequences), over the data-parallel group (and, with
    ``pp`` the :class:`PipelineParallel`, its stages, whose backward passes hand over each microbatch's gradients)."""
    t = cfg.training
    if not t.layout_invariant:
        return None
    v = virtual_dp_degree(t)
    c = canonical_microbatch_size(cfg)
    split = batch_split(t.global_batch_size, t.local_batch_size, dims.dp, v)
    dp_group = dims.get_mesh("dp").get_group() if dims.built and dims.dp_enabled else None
    return InvariantReduction(
        model_parts,
        microbatches=split.global_batch // (v * c),
        virtual=v,
        canonical_size=c,
        dp_group=dp_group,
        pp_group=None if pp is None else pp.pp_group,
        stages=() if pp is None else pp.stages,
    )
