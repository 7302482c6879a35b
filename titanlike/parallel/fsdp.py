"""FSDP2 (``fully_shard``) and HSDP over the data-parallel mesh, composing with tensor parallelism.

Groups, in order (roles from the model's spec, titanlike/models/spec.py): every transformer block, then the input
modules (token / position embeddings), then the final norm + output head together, then the root (whatever is left:
rotary buffers need nothing; a tied embedding/head weight is left to the root so that ONE group owns it). Each
group all-gathers its parameters in one collective before its forward and reduce-scatters its gradients in one
collective after its backward.

* A 1-D ``dp_mesh`` shards parameters over all its ranks (FSDP); a 2-D ``("dp_replicate", "dp_shard_cp")``
  mesh shards over the second dim and replicates over the first (HSDP: reduce-scatter, then all-reduce).
* Parameters that are already DTensors (tensor parallelism) get a 2-D layout ``(dp..., tp)``.
* Gradients are **summed** over the data-parallel ranks, never averaged: the loss is already divided by the
  global token count (``titanlike.training.step``), so averaging would divide by the dp degree twice.
* ``reshard_after_forward``: ``"always"`` frees gathered parameters after each group's forward and gathers
  them again in the backward (less memory, more communication); ``"never"`` keeps them; ``"default"`` is
  decided per group by ``titanlike.layout.reshard_after_forward`` (the planner prices the same answer).
* ``param_dtype`` / ``reduce_dtype``: FSDP's mixed precision (bf16 compute copies of fp32 master
  parameters, fp32 gradient reduction); ``None`` keeps the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titanlike.layout import RESHARD_CHOICES
from titanlike.layout import reshard_after_forward as reshard_policy
from titanlike.models import block_container_of, spec_for
from titanlike.parallel.fused import fsdp_placement, prepare_fused_for_fsdp
from titanlike.parallel.ties import tie_groups

__all__ = ["apply_fsdp", "offload_policy", "RESHARD_CHOICES"]


def _sum_gradients(module: FSDPModule) -> None:
    """Reduce gradients with SUM (divide factor 1, no AVG / PREMUL_SUM ops: gloo has no PREMUL_SUM)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's offload policy: none, or host memory, pinned only for a CUDA mesh (pinning needs an accelerator; on a
    CPU mesh the host is the device and FSDP's copies are no-ops)."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def runs_forward(module: nn.Module) -> bool:
    """Whether ``module`` is called itself (a container, ``ModuleDict`` / ``ModuleList``, only holds modules that are):
    FSDP's hooks on a module that never runs forward never fire."""
    return not isinstance(module, (nn.ModuleDict, nn.ModuleList))


def _role_groups(model: nn.Module, spec) -> tuple[list[nn.Module], list[nn.Module]]:
    """The input modules and the output modules with parameters this model (or stage) holds, by its spec's roles,
    less those that own a parameter shared between the two (a tied embedding / head stays with the root: ONE group
    owns it)."""
    if spec is None:
        return [], []
    # a module without parameters gets no group: DeepSeek-V3's empty ``mtp`` ModuleDict (mtp_layers 0) never runs
    # forward, and torch 2.11's FSDP then reduces its group's gradients wrong from step 2 on (2.13: a warning only)
    present = [
        n
        for n in (*spec.input_modules, *spec.output_modules)
        if getattr(model, n, None) is not None and any(True for _ in getattr(model, n).parameters())
    ]
    # the owners of every parameter tied across the input and output modules (by identity: titanlike.parallel.ties)
    owners = [{name.split(".")[0] for name in names} & set(present) for names in tie_groups(model)]
    tied = set().union(*(o for o in owners if o & set(spec.input_modules) and o & set(spec.output_modules)))
    # nor does a container (ModuleDict / ModuleList: DeepSeek-V3's ``mtp`` depths), which never runs forward itself:
    # torch 2.11 runs a list group's post-forward once every module of the list has run forward, and the head group
    # then stayed unsharded after an evaluation and trained wrong; the root group takes its parameters
    present = [n for n in present if runs_forward(getattr(model, n))]
    inputs = [getattr(model, n) for n in spec.input_modules if n in present and n not in tied]
    if tied:  # the tied pair and everything grouped with it (the head's group) go to the root
        return inputs, []
    return inputs, [getattr(model, n) for n in spec.output_modules if n in present]


def _check_ties_in_one_group(model: nn.Module, groups: list[list[nn.Module]]) -> None:
    """A parameter tied under several names (by identity) must have all its names in one FSDP group: two groups
    would each manage it, and torch fails at the first forward with a message naming no module. Refused here, in
    one line naming every split tie."""
    tied = tie_groups(model)
    if not tied:
        return
    group_of: dict[int, int] = {}
    for i, modules in enumerate(groups):
        for m in modules:
            for sub in m.modules():
                group_of[id(sub)] = i  # later (inner) groups win: fully_shard of an inner module comes first
    named = dict(model.named_modules(remove_duplicate=False))

    def where(name: str) -> int:
        return group_of.get(id(named[name.rpartition(".")[0]]), -1)  # -1: the root group

    split = [names for names in tied if len({where(n) for n in names}) > 1]
    if split:
        shown = "; ".join(" = ".join(names) for names in split)
        raise ValueError(
            f"apply_fsdp: blocks= splits tied parameter(s) across FSDP groups ({shown}); the modules sharing a "
            f"parameter must be in one group: leave them out of blocks= (the root group owns the tie) or list a "
            f"module holding all of them"
        )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: str = "default",
    pp_enabled: bool = False,
    blocks: Iterable[nn.Module | Sequence[nn.Module]] | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``dp_mesh`` (1-D: FSDP, 2-D: HSDP); return it.

    ``blocks`` are the modules that get their own group, or lists of modules that share one (torch's list form:
    ``[[model.transformer.wte, model.lm_head], *model.transformer.h]`` keeps a tied pair in one group); default:
    the children of the model spec's block container, ``model.layers``. A registered model's input modules
    (embeddings) and output modules (norm + head) get one group each unless they share the tied weight; the root
    takes the rest. A model with no spec and no ``.layers`` needs ``blocks`` (``blocks=[]``: one root group on
    purpose); ``blocks`` that put the names of a tied parameter in different groups are refused. Chunk-sharded fused
    projections (:class:`~titanlike.parallel.fused.FusedColwiseParallel`) are sharded on dim 1. Works on the meta
    device.

    ``cpu_offload``: FSDP2's :class:`~torch.distributed.fsdp.CPUOffloadPolicy` for every group: the sharded
    parameters, gradients (and so the optimizer state and step) in host memory, pinned when the mesh is CUDA's; the
    sharded parameters must be materialised on the CPU (``titanlike.parallel.materialize``: ``param_device``).
    """
    if reshard_after_forward not in RESHARD_CHOICES:
        raise ValueError(f"reshard_after_forward must be one of {RESHARD_CHOICES}, got {reshard_after_forward!r}")
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D (FSDP) or 2-D (HSDP: replicate, shard) mesh, got {dp_mesh}")

    def reshard(group: str) -> bool:
        return reshard_policy(reshard_after_forward, group, pp_enabled)

    kw = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=offload_policy(cpu_offload, dp_mesh.device_type),
    )

    prepare_fused_for_fsdp(model)
    kw["shard_placement_fn"] = fsdp_placement

    spec = spec_for(model)
    if blocks is None:
        container = block_container_of(model)
        if container is None:
            raise ValueError(
                f"apply_fsdp: {type(model).__name__} has no block container (.layers) and no model spec, "
                f"so every parameter would land in one root group; pass blocks=[...] (the modules that "
                f"each get their own FSDP group), or blocks=[] for one group on purpose"
            )
        blocks = list(container.children())
    # a group is a module or, torch's list form, several modules sharing one group (a tied embedding and head)
    blocks = [list(b) if isinstance(b, (list, tuple)) else b for b in blocks]
    inputs, outputs = _role_groups(model, spec)
    _check_ties_in_one_group(model, [b if isinstance(b, list) else [b] for b in blocks] + [inputs, outputs])
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard("block"), **kw)
    if inputs:
        fully_shard(inputs if len(inputs) > 1 else inputs[0], reshard_after_forward=reshard("embedding"), **kw)
    if outputs:
        fully_shard(outputs, reshard_after_forward=reshard("head"), **kw)
    fully_shard(model, reshard_after_forward=reshard("root"), **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            _sum_gradients(m)
    return model
