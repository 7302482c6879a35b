"""Compose the parallelisms on one model (or one pipeline stage), in the order that works:

0. float8 (``float8.backend=torchao``): ``nn.Linear`` -> torchao ``Float8Linear``, same parameter names;
1. tensor (+ sequence) parallelism (torchao's float8 styles when every projection is tensorwise float8), with
   the head left vocab-sharded for the vocab-parallel loss; then context parallelism (the attention core swapped,
   rotary tables at global positions); then expert parallelism (``ep > 1``: the routed experts ``Shard(0)`` over
   ``ep``, tokens by all-to-all; ``titanlike.parallel.expert_parallel``);
2. activation checkpointing (hooks of the TP styles on submodules rerun inside the recomputation);
3. ``torch.compile`` per block (sees DTensors between blocks, and the checkpoint regions);
4. FSDP / HSDP over ``dp_shard x cp`` (and ``dp_replicate``), outermost so that its all-gathers and
   reduce-scatters wrap everything else; under ep the routed experts first get their own FSDP groups over the
   ranks holding the same experts (``dp_shard_mod_ep``), gradients summed like every group.

``cfg`` is a ``titanlike.config.JobConfig`` (read, never imported: the parallel layer sits below the config).

Data parallelism without sharding (``dp_replicate > 1``, ``dp_shard = 1``) is HSDP with a shard group of one:
the same code path, gradients all-reduced. One rank per model copy (no dp) gets no FSDP at all: wrapping is
not free (docs/facts.md, "FSDP on one rank").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from titanlike.kernels.float8 import (
    convert_experts_to_float8,
    convert_to_float8,
    experts_float8_unavailable,
    float8_tensorwise_tp,
)
from titanlike.layout import float8_backend, loss_parallel_enabled, precision_policy
from titanlike.layout import reshard_after_forward as reshard_policy
from titanlike.loss import cross_entropy_loss
from titanlike.models import spec_for
from titanlike.models.moe import set_expert_dispatch
from titanlike.parallel.activation_checkpoint import apply_ac
from titanlike.parallel.activation_offload import apply_activation_offload
from titanlike.parallel.compile import apply_compile
from titanlike.parallel.dims import ParallelDims
from titanlike.parallel.expert_parallel import (
    apply_ep,
    apply_expert_fsdp,
    apply_moe_token_fsdp,
    experts_modules,
    set_aux_sequence_group,
)
from titanlike.parallel.fsdp import apply_fsdp
from titanlike.parallel.loss_parallel import loss_parallel_cross_entropy
from titanlike.parallel.tensor_parallel import apply_tp
from titanlike.sharding import float8_patterns

__all__ = ["parallelize_model", "build_loss_fn", "loss_parallel_enabled", "loss_group"]


def loss_group(dims: ParallelDims):
    """The process group the loss is reduced over (token count and reported loss): every rank holding a different
    part of the global batch, ``dp x cp`` (None on one rank per model copy)."""
    if dims.cp_enabled:
        return dims.get_mesh("dp_cp").get_group()
    return dims.get_mesh("dp").get_group() if dims.dp_enabled else None


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    """float8 (torchao) -> TP(+SP, loss parallel) -> CP -> activation checkpointing (and offload) -> compile ->
    FSDP/HSDP (CPU offload), in
    place; returns ``model``.

    ``model`` may be on the meta device (then allocate and fill it with ``titanlike.parallel.materialize``, or
    ``to_empty_keeping_ties`` + ``init_weights``: a plain ``to_empty`` drops the gradient hooks of TP) or materialised
    (every rank must hold the same weights: TP and FSDP keep each rank's shard of its own copy). The meshes are
    ``dims``' (``dims.build_mesh(device_type)`` first, unless every degree is 1). Parameter names do not change.
    """
    _apply_float8_and_tp(model, dims, cfg)
    if dims.cp_enabled:
        from titanlike.parallel.context_parallel import apply_cp

        p = cfg.parallelism
        apply_cp(model, dims.get_mesh("cp"), method=p.context_parallel_method, a2a_degree=p.context_parallel_a2a_degree)
    # (a pipeline stage of dense blocks only holds no experts; a model without any is refused by the rule ep_model)
    has_experts = dims.ep_enabled and bool(experts_modules(model))
    if experts_modules(model) and (dims.cp_enabled or dims.ep_tp > 1):
        # the aux loss of a sequence split over cp (and tp, when the MoE blocks route each tp rank's own tokens)
        # counts the whole sequence's tokens
        set_aux_sequence_group(model, dims.get_mesh("cp_tp" if dims.ep_tp > 1 else "cp").get_group())
    if experts_modules(model):
        set_expert_dispatch(model, cfg.parallelism.expert_dispatch)
    if has_experts:
        apply_ep(model, dims.get_mesh("ep"))
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint)
    if cfg.activation_checkpoint.offload:
        apply_activation_offload(model)
    if cfg.compile.enable:
        apply_compile(model, cfg.compile)
    _apply_data_parallel(model, dims, cfg, has_experts)
    return model


def _apply_float8_and_tp(model: nn.Module, dims: ParallelDims, cfg) -> None:
    """torchao float8 (the model's float8-eligible Linears, or every Linear of an unregistered module), then TP."""
    p = cfg.parallelism
    f8 = cfg.float8
    spec = spec_for(model)
    float8_modules = None  # None: every Linear (a module that is not a registered model)
    if spec is not None and (f8.recipe or dims.tp_enabled):
        float8_modules = float8_patterns(spec.sharding_of(getattr(model, "args", None)))
    if f8.recipe and float8_backend(cfg) == "torchao" and not hasattr(model, "_float8_converted"):
        convert_to_float8(
            model,
            f8.recipe,
            emulate=f8.emulate,
            filter_fqns=f8.filter_fqns,
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather and dims.fsdp_enabled,
            modules=float8_modules,
        )
        if experts_modules(model) and experts_float8_unavailable(f8.emulate) is None:
            convert_experts_to_float8(model)  # the routed experts' grouped GEMMs (the start-up line says which)
    if dims.tp_enabled:
        float8_tp = float8_modules is not None and float8_tensorwise_tp(model, float8_modules)
        tp_mesh = dims.get_mesh("tp")
        if p.enable_sequence_parallel and tp_mesh.device_type == "cpu":
            # gloo cannot all-gather float8 dtypes ("RuntimeError: Invalid scalar type", torch 2.13): on CPU the SP
            # all-gathers stay high precision (plain styles); NCCL moves float8 bytes.
            float8_tp = False
        apply_tp(
            model,
            tp_mesh,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=loss_parallel_enabled(cfg, dims),
            float8=float8_tp,
        )


def _apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg, has_experts: bool) -> None:
    """FSDP / HSDP (bf16 parameters over float32 master weights under mixed precision); the experts' own groups
    first, and under ep borrowing tp each MoE block's token-local parameters over the ranks routing their own."""
    p = cfg.parallelism
    mixed = precision_policy(cfg.training.dtype, dims, cfg.training.layout_invariant) == "fsdp"
    expert_fsdp = dict(
        param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
        reshard_after_forward=reshard_policy(p.fsdp_reshard_after_forward, "block", dims.pp_enabled),
    )
    if has_experts and dims.ep_tp > 1:
        # ep borrows tp: the experts' own groups, then each MoE block's router and shared experts FSDP-sharded over
        # every rank that routes tokens of its own (dp_shard x cp x tp), gradients summed, even without dp
        apply_expert_fsdp(model, dims.expert_fsdp_mesh(), **expert_fsdp)
        apply_moe_token_fsdp(model, dims.moe_token_mesh(), **expert_fsdp)
    if dims.fsdp_wraps:
        dp_mesh = dims.fsdp_mesh()
        if has_experts and dims.ep_tp == 1:  # each GroupedExperts its own group, before the blocks' take the rest
            apply_expert_fsdp(model, dims.expert_fsdp_mesh(), **expert_fsdp)
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=torch.bfloat16 if mixed else None,
            reduce_dtype=torch.float32 if mixed else None,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            pp_enabled=dims.pp_enabled,
            cpu_offload=cfg.training.enable_cpu_offload,
        )


def build_loss_fn(cfg, dims: ParallelDims) -> Callable[[Tensor, Tensor], Tensor]:
    """``loss_fn(logits, labels) -> sum of the cross entropy`` over the non-ignored tokens.

    With tensor parallelism (and loss parallel not disabled) the logits are a DTensor sharded on the vocab dim
    over ``dims.get_mesh("tp")`` and the loss is the vocab-parallel cross entropy; otherwise plain
    ``cross_entropy_loss``. ``parallelism.loss_chunk_size`` (0: off) bounds the float32 working set.
    """
    chunk = cfg.parallelism.loss_chunk_size or None
    if loss_parallel_enabled(cfg, dims):
        tp_mesh = dims.get_mesh("tp") if dims.built else None

        def vocab_parallel_loss(logits: Tensor, labels: Tensor) -> Tensor:
            if tp_mesh is not None and getattr(logits, "device_mesh", tp_mesh) != tp_mesh:
                raise ValueError(
                    f"vocab-parallel loss: logits live on {logits.device_mesh}, expected the tp mesh "
                    f"{tp_mesh}; parallelize the model with the same mesh"
                )
            return loss_parallel_cross_entropy(logits, labels, reduction="sum", chunk_size=chunk)

        return vocab_parallel_loss
    return partial(cross_entropy_loss, reduction="sum", chunk_size=chunk)
