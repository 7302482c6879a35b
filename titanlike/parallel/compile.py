"""``torch.compile`` per transformer block, in place, parameter names unchanged.

Each block of ``model.layers`` is compiled with :meth:`nn.Module.compile` (``fullgraph=True``, except for blocks
holding Transformer Engine modules, whose custom kernels make dynamo break the graph around them, or an MoE block,
whose routing does): the module
keeps its identity and its parameter names, unlike ``torch.compile(block)``, which returns an
``OptimizedModule`` that prefixes every name with ``_orig_mod.``. All blocks share one code object, and
dynamo lifts their parameters to graph inputs, so one compilation serves every block of the same shape.

Order (``parallelize_model``): tensor parallelism, then activation checkpointing, then this, then FSDP.
Compiling after AC lets dynamo trace ``torch.utils.checkpoint`` (including selective op-level policies) into
the graph; FSDP2's hooks, registered afterwards, are disabled for dynamo and run eagerly around the compiled
block. With tensor parallelism, blocks must exchange DTensors (``use_local_output=False`` on the layers that
feed and leave the blocks): compiled blocks returning plain local tensors fail in the backward on torch 2.13
(see the notes in ``docs/performance.md``).
"""

from __future__ import annotations

from torch import nn

from titanlike.models import block_container_of
from titanlike.models.moe import MoE

__all__ = ["apply_compile"]


def _fullgraph(block: nn.Module) -> bool:
    """Whether dynamo can capture ``block`` as one graph: not with Transformer Engine modules inside, nor with an
    MoE block (its routing has data-dependent shapes: ``bincount``, the expert-sorted rows, and under expert
    parallelism the split sizes read on the host; dynamo breaks the graph there and compiles the rest)."""
    return not any(type(m).__module__.startswith("transformer_engine") or isinstance(m, MoE) for m in block.modules())


def apply_compile(model: nn.Module, compile_config) -> nn.Module:
    """Compile every block of ``model``'s block container (its spec's; ``.layers`` for an unregistered module) in
    place if ``compile_config.enable``; returns ``model``.

    ``compile_config`` has ``enable`` and ``backend``, as :class:`titanlike.config.Compile`. Compilation
    itself is lazy: it happens on the first forward of each new input shape.
    """
    if not compile_config.enable:
        return model
    layers = block_container_of(model)
    if layers is None:
        raise ValueError(
            f"compile needs a model with a block container (its spec's, or .layers), got {type(model).__name__}"
        )
    for block in layers.values():
        if getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError(f"block {type(block).__name__} is already compiled")
        block.compile(backend=compile_config.backend, fullgraph=_fullgraph(block))
    return model
