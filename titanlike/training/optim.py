"""AdamW over every model part, and the learning-rate schedule (linear warmup, then cosine / linear / WSD)."""

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
    """Multiplier of ``optimizer.lr`` for the update of step ``step`` (1-based, as logged).

    Linear warmup over ``warmup_steps`` (step 1 gets 1/(warmup+1) of the peak, never 0), then
    cosine or linear decay to ``min_lr_factor`` at the last step, or warmup-stable-decay: constant until the
    last ``decay_ratio`` of the steps, then linear decay; ``constant`` stays at the peak.
    """
    s = cfg.lr_scheduler
    total, warmup, floor = cfg.training.steps, s.warmup_steps, s.min_lr_factor
    if step <= warmup:
        return step / (warmup + 1)
    if s.decay_type == "constant" or total <= warmup:
        return 1.0
    if s.decay_type == "wsd":
        decay_steps = max(1, round((total - warmup) * s.decay_ratio))
        start = total - decay_steps
        if step <= start:
            return 1.0
        progress = (step - start) / decay_steps
        return floor + (1.0 - floor) * (1.0 - progress)
    progress = min(1.0, (step - warmup) / (total - warmup))
    if s.decay_type == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose ``last_epoch`` counts completed steps (its state_dict goes into checkpoints)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i + 1, cfg))
