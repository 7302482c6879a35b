"""The one builder of a parallelized model: what the trainer trains, the numerics gate checks and the benchmark
times, so the gate tests the exact code path users run.

``build_parallel_model(model, cfg, dims, mesh, device)`` takes the plain single-device model (built from its
spec, seeded: the same weights on every rank, or on the meta device when the weights will come from a
checkpoint) and returns a :class:`ParallelModel`: this rank's model parts, the scaled loss, the gradient-clipping
function, the forward context (bf16 autocast when the layout's precision policy says so) and, under pipeline
parallelism, the :class:`~titanlike.parallel.pipeline.PipelineParallel` with its schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.layout import precision_policy
from titanlike.loss import ScaledLoss
from titanlike.parallel.clip import clip_grad_norm_, plain_clip_grad_norm_
from titanlike.parallel.dims import ParallelDims
from titanlike.parallel.parallelize import build_loss_fn, parallelize_model
from titanlike.parallel.pipeline import PipelineParallel, apply_pp

__all__ = ["ParallelModel", "build_parallel_model"]


@dataclass
class ParallelModel:
    """This rank's share of the parallelized model and what a train step needs to run it."""

    model_parts: list[nn.Module]  # one module, or this rank's pipeline stages in stage order
    loss: ScaledLoss  # sum(CE) / denominator (the train step sets the global token count)
    clip_fn: Callable  # clip_fn(parameters, max_norm) -> global grad norm over every rank and stage
    forward_context: Callable[[], contextlib.AbstractContextManager]  # wraps forward + loss (not the backward)
    pp: PipelineParallel | None = None  # the stages and the schedule under pipeline parallelism

    @property
    def pp_schedule(self):
        return None if self.pp is None else self.pp.schedule

    @property
    def pp_group(self):
        return None if self.pp is None else self.pp.pp_group

    @property
    def has_last_stage(self) -> bool:
        return self.pp is None or self.pp.has_last_stage


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, then tie again the parameters that were one parameter under several names (tied
    embeddings): ``to_empty`` gives every module its own new tensor."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for names in groups.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)


def _null_context() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def build_parallel_model(model: nn.Module, cfg, dims: ParallelDims, mesh, device: torch.device, *,
                         meta_init: bool = False) -> ParallelModel:
    """Parallelize the plain ``model`` for the layout ``dims`` on ``mesh`` (None: one process, no mesh) and move
    it to ``device``.

    ``cfg`` is a ``titanlike.config.JobConfig``. ``meta_init``: ``model`` is on the meta device (its weights will
    be loaded from a checkpoint); only this rank's shards are allocated, with placeholder values. Under pipeline
    parallelism ``model`` is the full model the stages are cut from (``apply_pp``); each bf16 stage enters autocast
    itself, because the schedule interleaves forwards and backwards.
    """
    if dims.pp_enabled:
        pp = apply_pp(model, dims, mesh, cfg, device)
        return ParallelModel(model_parts=pp.model_parts, loss=pp.loss, clip_fn=pp.finalize_grads_and_clip_,
                             forward_context=_null_context, pp=pp)
    model = parallelize_model(model, dims, mesh, cfg)
    loss = ScaledLoss(build_loss_fn(cfg, dims, mesh))
    if meta_init:  # allocate this rank's shards; values are placeholders until the checkpoint loads
        to_empty_keeping_ties(model, device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    else:
        model.to(device)
    if precision_policy(cfg.training.dtype, dims) == "autocast":
        def forward_context() -> contextlib.AbstractContextManager:
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        forward_context = _null_context
    clip_fn = plain_clip_grad_norm_ if mesh is None else clip_grad_norm_
    return ParallelModel(model_parts=[model], loss=loss, clip_fn=clip_fn, forward_context=forward_context)
