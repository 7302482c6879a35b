"""``torch.compile`` per transformer block, in place, parameter names unchanged.

Each block of the model's block container, and each block its output modules run (DeepSeek-V3's MTP depths), is
compiled as :meth:`nn.Module.compile` does (``fullgraph=True`` in every family, MoE blocks included, except for
blocks holding Transformer Engine modules and MoE blocks under expert parallelism: :func:`_fullgraph`): the module
keeps its identity and its parameter names, unlike ``torch.compile(block)``, which returns an
``OptimizedModule`` that prefixes every name with ``_orig_mod.``. All blocks share one code object, and
dynamo lifts their parameters to graph inputs, so one compilation serves every block of the same kind.

Order (``parallelize_model``): tensor parallelism, then activation checkpointing, then this, then FSDP.
Compiling after AC lets dynamo trace ``torch.utils.checkpoint`` (including selective op-level policies) into
the graph; FSDP2's hooks, registered afterwards, are disabled for dynamo and run eagerly around the compiled
block. With tensor parallelism, blocks must exchange DTensors (``use_local_output=False`` on the layers that
feed and leave the blocks): compiled blocks returning plain local tensors fail in the backward on torch 2.13
(see the notes in ``docs/performance.md``).
"""

from __future__ import annotations

import torch
from torch import nn

from titanlike.models import block_container_of, spec_for
from titanlike.models.moe import GroupedExperts, MoE

__all__ = ["apply_compile", "compiled_blocks"]


def _fullgraph(block: nn.Module) -> bool:
    """Whether dynamo captures ``block`` as one graph (``fullgraph=True``, a graph break is an error).

    Yes for every block but two kinds: one holding Transformer Engine modules (their custom kernels make dynamo
    break the graph around them), and an MoE block under expert parallelism (its experts already sharded by
    ``apply_ep``, which runs before this), whatever the dispatch: the FSDP groups that come with ep inside the block
    (the experts' own, over the ranks holding the same experts, and the MoE block's under ep borrowing tp) run
    FSDP2's forward hooks, which torch 2.13 always hides from dynamo (``torch._dynamo.disable``, no setting traces
    them), so dynamo breaks the graph there and compiles the rest. The uneven dispatch breaks it once more where it
    reads the exchanged split sizes on the host and checks them; the padded one (``parallelism.expert_dispatch
    padded``) has no host read, only the hooks' breaks (docs/performance.md has the counts). A single-device or
    data-parallel MoE block is captured whole: its expert counts have a static shape (``expert_counts``) and the
    rows per expert, read on the host for the split, become unbacked symbolic sizes (``capture_scalar_outputs``,
    patched around the block's call by :func:`apply_compile`), so they neither break the graph nor recompile when
    the routing changes."""
    return not any(
        type(m).__module__.startswith("transformer_engine") or (isinstance(m, GroupedExperts) and _sharded(m.w1))
        for m in block.modules()
    )


def _sharded(w) -> bool:
    return hasattr(w, "to_local")  # a DTensor (the model side imports nothing of torch.distributed either)


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :func:`apply_compile` compiles: every block of ``model``'s block container, then the blocks its
    output modules run (the spec's ``prediction_blocks``: DeepSeek-V3's MTP depths) that this model or pipeline
    stage holds."""
    layers = block_container_of(model)
    if layers is None:
        raise ValueError(
            f"compile needs a model with a block container (its spec's, or .layers), got {type(model).__name__}"
        )
    blocks = list(layers.values())
    spec, args = spec_for(model), getattr(model, "args", None)
    if spec is not None and args is not None:
        held = dict(model.named_modules())
        blocks += [held[fqn] for fqn in spec.prediction_blocks(args) if fqn in held]
    return blocks


def apply_compile(model: nn.Module, compile_config) -> nn.Module:
    """Compile every block of ``model``'s block container (its spec's; ``.layers`` for an unregistered module) in
    place if ``compile_config.enable``; returns ``model``.

    ``compile_config`` has ``enable`` and ``backend``, as :class:`titanlike.config.Compile`. Compilation
    itself is lazy: it happens on the first forward of each new input shape.
    """
    if not compile_config.enable:
        return model
    blocks = compiled_blocks(model)
    settings = _dynamo_settings(blocks)
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError(f"block {type(block).__name__} is already compiled")
        # as ``nn.Module.compile`` (the module keeps its identity and parameter names), the dynamo settings patched
        # around each call only: dynamo reads them when it traces (resumed frames after a break included), and the
        # rest of the process keeps its own
        compiled = torch.compile(block._call_impl, backend=compile_config.backend, fullgraph=_fullgraph(block))
        block._compiled_call_impl = _scoped(compiled, settings) if settings else compiled
    return model


def _dynamo_settings(blocks: list[nn.Module]) -> dict[str, bool]:
    """The dynamo settings the blocks are traced under, none but for MoE blocks: their rows per expert (a host read,
    ``.tolist()``) traced as unbacked symbolic sizes (``capture_scalar_outputs``: no graph break there, no guard on
    their values), and under activation checkpointing their load counters and aux-loss sum (attribute and buffer
    updates) not replayed by the recomputation, as in eager (the block counts nothing inside the backward;
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``, where torch has it)."""
    if not any(isinstance(m, MoE) for block in blocks for m in block.modules()):
        return {}
    settings = {"capture_scalar_outputs": True}
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        settings["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    return settings


def _scoped(compiled, settings: dict[str, bool]):
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(settings):
            return compiled(*args, **kwargs)

    return call
