"""AdamW over every model part, and the learning-rate schedule (torchtitan's warmup -> stable -> decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from titanlike.config import JobConfig


def build_optimizer(model_parts: list[nn.Module], cfg: JobConfig) -> torch.optim.Optimizer:
    """One AdamW over the parameters of all model parts (pipeline stages held by this rank).

    Norm weights and other 1-D parameters get no weight decay. ``optimizer.implementation=auto`` uses the fused
    kernel on CUDA and the foreach one elsewhere.
    """
    o = cfg.optimizer
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = o.implementation
    if impl == "auto":
        impl = "fused" if params and params[0].device.type == "cuda" else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"} if impl != "for-loop" else {"foreach": False}
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kwargs)


def lr_factor(step: int, cfg: JobConfig) -> float:
    """Multiplier of ``optimizer.lr`` for the update of step ``step`` (1-based, as logged): torchtitan's schedule.

    Over ``total`` = ``lr_scheduler.total_steps`` (default ``training.steps``) steps: linear warmup over
    ``warmup_steps`` (step s gets s / warmup, reaching the peak at step ``warmup``), then stable at the peak, then
    decay over the last ``round(total * decay_ratio)`` steps (all the steps after warmup when ``decay_ratio`` is
    unset) from 1 towards ``min_lr_factor`` — linear, sqrt (1 - sqrt(progress)) or cosine, whatever the decay type.
    ``wsd`` is linear with ``decay_ratio`` 0.2 unless set; ``constant`` stays at the peak after warmup. Past
    ``total`` (a longer run) the factor stays at ``min_lr_factor``.
    """
    s = cfg.lr_scheduler
    total = s.total_steps if s.total_steps is not None else cfg.training.steps
    warmup = min(s.warmup_steps, total)
    i = step - 1  # torchtitan's LambdaLR argument: completed steps
    if i < warmup:
        return (i + 1) / warmup
    if s.decay_type == "constant":
        return 1.0
    ratio = s.decay_ratio if s.decay_ratio is not None else (0.2 if s.decay_type == "wsd" else None)
    decay = total - warmup if ratio is None else min(round(total * ratio), total - warmup)
    stable = total + 1 - warmup - decay
    if i < warmup + stable:
        return 1.0
    progress = min(1.0, (i + 1 - warmup - stable) / decay)
    if s.decay_type in ("linear", "wsd"):
        adjust = 1.0 - progress
    elif s.decay_type == "sqrt":
        adjust = 1.0 - math.sqrt(progress)
    else:
        adjust = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_factor + (1.0 - s.min_lr_factor) * adjust


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose ``last_epoch`` counts completed steps (its state_dict goes into checkpoints)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i + 1, cfg))
