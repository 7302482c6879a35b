"""Activation checkpointing (AC) of transformer blocks, with parameter names left unchanged.

Modes (``JobConfig.activation_checkpoint``):

* ``none``: nothing changes.
* ``full``: every block of ``model.layers`` keeps only its inputs; its forward is recomputed in the backward.
* ``selective`` with an integer ``N``: blocks whose global layer index is a multiple of ``N`` (0, N, 2N, ...)
  are fully checkpointed. The global index (the ``model.layers`` key) is used rather than the position in this
  module, so every pipeline layout checkpoints the same blocks as one device. ``N = 1`` equals ``full``.
* ``selective`` with ``"op"``: every block is checkpointed op by op with
  :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: the outputs of matmuls (``mm``, ``addmm``,
  ``bmm``), of the fused attention kernels and of collectives are saved; everything else (norms, RoPE, SiLU,
  element-wise products, casts) is recomputed. This keeps the expensive work and communication out of the
  recomputation while dropping most of the element-wise activations.

How the names stay put: :class:`torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper`
nests the block under ``_checkpoint_wrapped_module.``, which changes every parameter name. Instead, a block's
class is swapped in place for a subclass whose ``forward`` runs the original one under non-reentrant
:func:`torch.utils.checkpoint.checkpoint` (the same device ``fully_shard`` uses for its ``FSDP<Block>``
classes). The module object, its parameters and their names are unchanged; ``isinstance(block,
TransformerBlock)`` still holds. Hooks registered on the block itself (FSDP's unshard/reshard, TP's input
preparation) run outside the checkpointed region, as with the wrapper; hooks on its submodules (TP's
``wq``/``wo`` redistributions) run again during the recomputation. Apply after tensor parallelism and before
``torch.compile`` and FSDP (``parallelize_model`` does this). Non-reentrant checkpointing works with DTensor
parameters, FSDP2 and pipeline stages. A checkpointed model can't be pickled whole (``torch.save(model)``);
state dicts are unaffected.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from titanlike.layout import ac_block_mode
from titanlike.models import block_container_of

__all__ = ["apply_ac", "checkpoint_block", "is_checkpointed", "SAC_SAVE_OPS"]


def _ops(namespace: str, names: list[str]) -> set:
    """The ``.default`` overloads of the named ops that exist in this torch build."""
    ns = getattr(torch.ops, namespace)
    return {getattr(ns, n).default for n in names if hasattr(ns, n)}


# Outputs that selective op-level AC saves; everything else is recomputed in the backward.
SAC_SAVE_OPS: frozenset = frozenset(
    _ops(
        "aten",
        [
            "mm",
            "addmm",
            "bmm",  # nn.Linear lowers to mm / addmm; the math attention path to bmm
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable",
            "max",  # a scalar per tensor: float8 scaling reads amaxes, recomputing them would be wasted reductions
        ],
    )
    | _ops(
        "_c10d_functional",
        [  # what DTensor / functional collectives dispatch to under TP and SP
            "all_reduce",
            "reduce_scatter_tensor",
            "all_gather_into_tensor",
            "all_to_all_single",
        ],
    )
)


def _sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# Profiler ranges carry no tensors, but torch >= 2.13's SAC matches every dispatched op of the recomputation with
# the forward's, and FSDP's hooks of a group nested inside a checkpointed block (the routed experts' own FSDP group,
# docs/moe.md) enter and exit ``record_function`` ranges a different number of times in the two ("profiler.
# _record_function_enter_new.default invocation index 2 encountered during backward but not found in storage").
# Ignored by SAC like ``aten.detach`` (torch's own SAC_IGNORED_OPS), which leaves every tensor op as it was.
_PROFILER_OPS = {
    getattr(getattr(torch.ops.profiler, name), overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if hasattr(torch.ops.profiler, name)
    for overload in getattr(torch.ops.profiler, name).overloads()
}


def _ignore_profiler_ops() -> None:
    """Once, when op-level AC is applied (not at every checkpointed forward)."""
    import torch.utils.checkpoint as torch_checkpoint

    ignored = getattr(torch_checkpoint, "SAC_IGNORED_OPS", None)  # (a set of torch's, absent before 2.13)
    if ignored is not None:
        ignored.update(_PROFILER_OPS)


def _selective_op_context_fn():
    return create_selective_checkpoint_contexts(_sac_policy)


class _Checkpointed:
    """Mixed into a block's class: ``forward`` runs the original forward under non-reentrant checkpointing."""

    _ac_context_fn = staticmethod(noop_context_fn)

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return super().forward(*args, **kwargs)
        if self._ac_context_fn is noop_context_fn:  # full AC: no context_fn (dynamo refuses the default passed in)
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=self._ac_context_fn, **kwargs)


@functools.cache
def _checkpointed_class(cls: type, selective_op: bool) -> type:
    name = f"{'OpCheckpointed' if selective_op else 'Checkpointed'}{cls.__name__}"
    context_fn = _selective_op_context_fn if selective_op else noop_context_fn
    return type(name, (_Checkpointed, cls), {"_ac_context_fn": staticmethod(context_fn), "__module__": cls.__module__})


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, _Checkpointed)


def checkpoint_block(block: nn.Module, selective_op: bool = False) -> nn.Module:
    """Make ``block`` recompute its forward in the backward (in place; returns ``block``).

    ``selective_op=True`` saves the outputs listed in :data:`SAC_SAVE_OPS` and recomputes the rest.
    """
    if is_checkpointed(block):
        raise ValueError(f"{type(block).__name__} already has activation checkpointing applied")
    if hasattr(block, "_compiled_call_impl") and block._compiled_call_impl is not None:
        raise ValueError("apply activation checkpointing before torch.compile, not after")
    if selective_op:
        _ignore_profiler_ops()
    block.__class__ = _checkpointed_class(type(block), selective_op)
    return block


def _layer_index(name: str, position: int) -> int:
    return int(name) if name.isdigit() else position


def apply_ac(model: nn.Module, ac_config) -> nn.Module:
    """Apply activation checkpointing to the blocks of ``model``'s block container (its spec's ``block_container``;
    ``.layers`` for an unregistered module) according to ``ac_config``.

    ``ac_config`` has ``mode`` (none | full | selective) and ``selective_ac_option`` ("op" or an integer N), as
    :class:`titanlike.config.ActivationCheckpoint`. Blocks are modified in place (parameter names, the module
    objects and the container's entries stay the same); returns ``model``.
    """
    mode, option = ac_config.mode, ac_config.selective_ac_option
    if ac_block_mode(mode, option, 0) == "none":  # validates mode and option; block 0 is checkpointed unless off
        return model
    layers = block_container_of(model)
    if layers is None:
        raise ValueError(
            f"activation checkpointing needs a model with a block container (its spec's, or .layers), got "
            f"{type(model).__name__}"
        )
    for position, (name, block) in enumerate(layers.named_children()):
        how = ac_block_mode(mode, option, _layer_index(name, position))
        if how != "none":
            checkpoint_block(block, selective_op=how == "op")
    return model
