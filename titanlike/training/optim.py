"""The optimizer over every model part (AdamW, or Muon with AdamW for the rest), and the learning-rate schedule
(torchtitan's warmup -> stable -> decay)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlike.config import JobConfig


def build_optimizer(
    model_parts: list[nn.Module], cfg: JobConfig, *, matrices: Mapping | None = None
) -> torch.optim.Optimizer:
    """The optimizer over the parameters of all model parts (pipeline stages held by this rank).

    ``optimizer.name = "AdamW"``: one AdamW; norm weights and other 1-D parameters get no weight decay.
    ``optimizer.implementation=auto`` uses the fused kernel on CUDA and the foreach one elsewhere.

    ``parallelism.distributed_optimizer``: AdamW's moments sharded over the replicated data-parallel ranks
    (ZeRO-1, ``titanlike.parallel.zero``).

    ``"Muon"``: ``titanlike.parallel.muon.Muon`` on the matrices the model's sharding entries declare (or
    ``matrices``: ``{parameter: its matrices}``, for a module that is not a registered model), AdamW (as above,
    with ``optimizer.adamw_lr`` / ``adamw_weight_decay``) on every other parameter. Collective under a parallel
    layout (every rank builds it).
    """
    o = cfg.optimizer
    params = list({id(p): p for m in model_parts for p in m.parameters() if p.requires_grad}.values())
    impl = o.implementation
    # ZeRO-1 shards the moments of a layout's DTensor parameters; the one-device copy of such a layout (the gate's and
    # titanlike.localize's reference) runs the same AdamW unsharded
    zero1 = cfg.parallelism.distributed_optimizer and any(isinstance(p, DTensor) for p in params)
    if impl == "auto":  # (the distributed optimizer's sharded moments go through DTensor's foreach ops)
        impl = "fused" if params and params[0].device.type == "cuda" and not zero1 else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"} if impl != "for-loop" else {"foreach": False}
    if o.name == "AdamW":
        opt = torch.optim.AdamW(
            _adamw_groups(params, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kwargs
        )
        if zero1:
            from titanlike.parallel.zero import shard_optimizer_state

            shard_optimizer_state(opt)
        return opt
    from titanlike.parallel.muon import Muon, muon_matrices

    if matrices is None:
        matrices = muon_matrices(model_parts)
    adamw_wd = o.weight_decay if o.adamw_weight_decay is None else o.adamw_weight_decay
    return Muon(
        [p for p in params if p in matrices],
        matrices=matrices,
        adamw_params=_adamw_groups([p for p in params if p not in matrices], adamw_wd),
        lr=o.lr,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_coefficients=tuple(o.ns_coefficients),
        eps=o.muon_eps,
        ns_steps=o.ns_steps,
        adjust_lr_fn=o.adjust_lr_fn,
        ns_dtype=getattr(torch, o.ns_dtype),
        bucket_mb=o.muon_bucket_mb,
        adamw_lr=o.lr if o.adamw_lr is None else o.adamw_lr,
        adamw_weight_decay=adamw_wd,
        adamw_kwargs={"betas": (o.beta1, o.beta2), "eps": o.eps, **kwargs},
    )


def _adamw_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW's two groups: weight decay for the matrices (embeddings, head), none for 1-D parameters."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


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
