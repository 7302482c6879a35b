"""Pipeline parallelism of a whole model: :func:`apply_pp` (the trainer's, from the config) and
:func:`pipeline_module` (any module, from a user's split). Both go through the one stage builder
(``titanlike.parallel.pipeline.build.build_stage``) and the one schedule builder (``runtime.make_pipeline``).

The pieces, in the order :func:`apply_pp` uses them:

* **Split** (``titanlike.layout.stage_module_names``): stage ``s`` holds a contiguous slice of the block container;
  the first stage also the input modules, the last the final norm and the output head (and computes the loss).
* **Place** (``titanlike.layout.stage_ids_for_rank``): loop style for single-stage and interleaved schedules (pp
  rank ``r`` holds stages ``r, r + pp, r + 2pp, ...``), V style for the schedules whose own stage map is a V
  (ZBVZeroBubble, DualPipeV: rank ``r`` holds ``r`` and ``2pp - 1 - r``, so rank 0 holds the first and last stage).
* **Build** each stage by deepcopy-and-delete on the full model (on the meta device the trainer's way: the stages
  are parallelized there and only this rank's shards are ever allocated, by the sharded init or a checkpoint load).
* **Parallelize** each stage module with ``parallelize_model`` over the non-pp mesh dims (TP, CP, AC, compile,
  FSDP). FSDP keeps parameters unsharded between forward and backward under PP
  (``titanlike.layout.reshard_after_forward``): the zero-bubble schedules run the weight-gradient half of the
  backward outside FSDP's hooks, and resharding after forward gives wrong or missing gradients there
  (docs/facts.md, "The zero-bubble resharding trap"); it also saves one all-gather per microbatch.
* **Schedule** by name, ``local_batch_size / pipeline_parallel_microbatch_size`` microbatches (``runtime``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from titanlike.layout import precision_policy, stage_module_names
from titanlike.models import spec_for
from titanlike.parallel.materialize import materialize
from titanlike.parallel.parallelize import build_loss_fn, parallelize_model
from titanlike.parallel.pipeline.build import check_split, dry_run
from titanlike.parallel.pipeline.runtime import PipelineParallel, make_pipeline

__all__ = ["apply_pp", "pipeline_module"]


def _stream_from_plain_tensor(stage: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Under TP the residual stream is a DTensor (``Shard(1)`` under SP, else ``Replicate()``); between stages it
    travels as its plain local tensor, like the data into the first stage: a stage without the input modules turns
    its input back into the DTensor. (Its output leaves as a plain tensor: ``runtime.local_copy``.)"""
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(
        stage, tp_mesh, PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=False)
    )


def apply_pp(model: nn.Module, dims, cfg, device: torch.device, *, init_seed: int | None = None) -> PipelineParallel:
    """Split the full ``model`` into this rank's stages, parallelize them, build the schedule.

    ``model`` on the meta device: the stages are built and parallelized on meta, then only this rank's shards are
    allocated and filled by the sharded init from ``init_seed`` (None: left for a checkpoint load). A materialised
    ``model``: each stage copies its values."""
    if spec_for(model) is None:
        raise ValueError(
            f"apply_pp: {type(model).__name__} is not a registered model (titanlike.models), whose config splits it "
            f"into stages; split your own module with pipeline_module(model, pp_mesh, module_fqns_per_stage, "
            f"loss_fn=..., n_microbatches=...)"
        )
    p = cfg.parallelism
    on_meta = next(model.parameters()).is_meta
    tp_mesh = dims.get_mesh("tp") if dims.tp_enabled else None
    autocast = precision_policy(cfg.training.dtype, dims, cfg.training.layout_invariant) == "autocast"

    def parallelize_stage(stage: nn.Module, is_first: bool, is_last: bool) -> nn.Module:
        if tp_mesh is not None and not is_first:
            _stream_from_plain_tensor(stage, tp_mesh, p.enable_sequence_parallel)
        stage = parallelize_model(stage, dims, cfg)
        if on_meta:
            materialize(stage, device, init_seed)
        if autocast:
            # bf16 without FSDP's mixed precision is autocast over float32 weights. The schedule interleaves
            # forwards and backwards, so the trainer cannot wrap the forward alone: each stage's forward enters it.
            stage.forward = torch.autocast(device.type, dtype=torch.bfloat16)(stage.forward)
        return stage

    pp = make_pipeline(
        model,
        dims.get_mesh("pp"),
        stage_module_names(cfg, model.args),
        loss_fn=build_loss_fn(cfg, dims),
        n_microbatches=cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size,
        schedule=p.pipeline_parallel_schedule,
        device=device,
        parallelize_stage=parallelize_stage,
    )
    pp.microbatch_size = p.pipeline_parallel_microbatch_size
    return pp


def pipeline_module(
    model: nn.Module,
    pp_mesh,
    module_fqns_per_stage: Sequence[Sequence[str]],
    *,
    loss_fn,
    n_microbatches: int,
    schedule: str = "1F1B",
    device: torch.device | str = "cpu",
    parallelize_stage: Callable[[nn.Module, bool, bool], nn.Module] | None = None,
    shared: Sequence[str] = (),
    example_input: torch.Tensor | None = None,
) -> PipelineParallel:
    """Pipeline-parallelize any module: stages from a user's split (module FQNs per stage), this rank's stages
    built and run by the ``schedule`` (any of :data:`~titanlike.layout.SCHEDULES`; loop placement, V placement for
    the V schedules).

    ``loss_fn(output, labels)`` returns the SUM of the loss over the microbatch (the trainer's ScaledLoss divides by
    the global token count); ``parallelize_stage(module, is_first, is_last)`` applies TP / FSDP to each stage module
    and returns it (optional). Parameters shared by identity across stages (tied embeddings) keep one copy per
    stage; :meth:`PipelineParallel.finalize_grads` sums their gradients between exactly the ranks holding a copy
    (call it through ``finalize_grads_and_clip_`` as the clip function). Returns a :class:`PipelineParallel`.

    ``shared``: module FQNs every stage holds (a rotary table the blocks of every stage call, a position table):
    each stage gets its own copy; one holding parameters is treated like a tie (the copies' gradients summed over
    the stages, the parameter counted once in the norm, the copies stay equal). Before anything is built, a
    meta-device dry run of the stages in order (``example_input``: the first stage's input, default ``(1, 4)``
    token ids; ``titanlike.parallel.pipeline.build.dry_run``) refuses a forward that calls a child which is ``None``
    on its stage, naming the child and the fix (skip it, or list it in ``shared``).
    """
    check_split(model, module_fqns_per_stage, shared)
    stages = [[*fqns, *shared] for fqns in module_fqns_per_stage]
    dry_run(model, stages, example_input)
    return make_pipeline(
        model,
        pp_mesh,
        stages,
        loss_fn=loss_fn,
        n_microbatches=n_microbatches,
        schedule=schedule,
        device=torch.device(device),
        parallelize_stage=parallelize_stage,
    )
