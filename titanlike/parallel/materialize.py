"""Allocate a parallelized model that was built on the meta device, and fill it.

The trainer builds every model on the meta device and parallelizes it there (TP, FSDP/HSDP, pipeline stages), so
no rank ever holds more than its shards. :func:`materialize` then allocates this rank's shards on the device,
computes the buffers (RoPE tables) and, on a fresh start, fills every shard with the model's sharded,
layout-independent init (``titanlike.init``: each element a pure function of (seed, FQN, index)); when the
weights come from a checkpoint the values are left for the load to write.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlike.init import init_parameters
from titanlike.models import spec_for
from titanlike.parallel.ties import retie, tie_groups

__all__ = ["materialize", "to_empty_keeping_ties", "keeping_grad_hooks", "param_init_for"]


def keeping_grad_hooks(model: nn.Module, apply) -> None:
    """Run ``apply()`` (``model.to_empty(...)`` or ``model.to(...)``) and register the parameters'
    post-accumulate-grad hooks again on the tensors it leaves.

    ``Module._apply`` replaces DTensor parameters through ``swap_tensors``: the hooks tensor parallelism registers
    on each parameter (they give a gradient its parameter's placements) stay behind on the old tensors, while the
    Python-side hook dict moves along and makes them look registered. Without them a sequence-parallel norm's
    gradient stays ``Partial`` (reduced late, inside the optimizer) and a vocab-parallel embedding's ``Replicate``
    (a full-vocabulary gradient on every rank); the gate checks every gradient's placements (docs/facts.md).
    """
    hooks = {name: list((p._post_accumulate_grad_hooks or {}).values()) for name, p in model.named_parameters()}
    marks = {
        name: {k: v for k, v in p.__dict__.items() if k.startswith("_titanlike")}
        for name, p in model.named_parameters()
    }
    apply()
    for name, p in model.named_parameters():
        if hooks.get(name):
            p._post_accumulate_grad_hooks = None
            for hook in hooks[name]:
                p.register_post_accumulate_grad_hook(hook)
        for k, v in marks.get(name, {}).items():
            setattr(p, k, v)


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, keeping what ``to_empty`` drops: parameters that were one parameter under several
    names (tied embeddings; ``to_empty`` gives every module its own new tensor) are tied again, and the parameters'
    post-accumulate-grad hooks are registered again (:func:`keeping_grad_hooks`)."""
    groups = tie_groups(model)
    keeping_grad_hooks(model, lambda: model.to_empty(device=device))
    retie(model, groups)


def param_init_for(model: nn.Module):
    """The init plan (``fqn -> Init``) of a registered model or pipeline stage of one; a ValueError otherwise."""
    spec = spec_for(model)
    if spec is None or spec.param_init is None:
        raise ValueError(
            f"{type(model).__name__} has no init plan: register a ModelSpec with param_init for it "
            f"(docs/adding_a_model.md), or call titanlike.init.init_parameters(module, plan, seed) "
            f"yourself after to_empty"
        )
    return spec.param_init(model.args)


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device, seed: int | None, param_device: torch.device | None = None
) -> None:
    """Allocate ``model``'s (this rank's) parameters on ``param_device`` (default ``device``; the CPU under FSDP's
    CPU offload), keeping ties, compute its buffers on ``device``, and fill the parameters with the model's init
    from ``seed`` (None: leave them for a checkpoint load to write)."""
    plan = param_init_for(model) if seed is not None else None
    to_empty_keeping_ties(model, param_device or device)
    init_buffers = getattr(model, "init_buffers", None)
    if init_buffers is not None:
        init_buffers(device)
    if seed is not None:
        init_parameters(model, plan, seed)
