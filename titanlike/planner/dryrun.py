"""Dry run: titanlike's own parallelize functions, for the real world size, in this one process.

A fake process group (``torch.testing._internal.distributed.fake_pg``: collectives return at once, nothing is
sent) of ``world_size`` ranks stands in for the job; this process plays one rank. It builds the same mesh as the
trainer (``ParallelDims.build_mesh``), the stage modules that rank holds on the meta device (no memory), and runs
``parallelize_model`` on them exactly as ``apply_pp`` / the trainer do: TP (+SP), activation checkpointing, FSDP2.
What comes out are the rank's real parameter shards: DTensor placements and local shapes.

The activation probe then measures one transformer block as that rank runs it: the block is built on meta, given
the run's tensor parallelism and activation checkpointing, materialised under ``FakeTensorMode`` (shapes and
dtypes, no storage) and run forward on a fake microbatch under ``MemTracker``; what the block holds after its
forward (saved tensors and selective-checkpoint caches, less its output) is its activation memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from titanlike.config import JobConfig
from titanlike.planner.layout import Layout

__all__ = ["DryRun", "ParamRecord", "dry_run"]


@dataclass(frozen=True)
class ParamRecord:
    stage: int
    name: str
    shape: tuple[int, ...]  # global
    local_shape: tuple[int, ...]  # this rank's shard
    dtype: torch.dtype
    placements: str  # "(Shard(dim=0), Shard(dim=0)) on (dp_shard_cp, tp)" or "plain tensor"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class DryRun:
    rank: int
    world_size: int
    params: list[ParamRecord]
    seconds: float
    block_activation_bytes: int | None = None  # measured for one block and one microbatch (None: not probed)
    probe_layer: int | None = None
    notes: list[str] = field(default_factory=list)


def _describe(p) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        return tuple(p.shape), tuple(p.to_local().shape), f"{tuple(p.placements)} on {names}"
    return tuple(p.shape), tuple(p.shape), "plain tensor"


def dry_run(cfg: JobConfig, layout: Layout, args, rank: int = 0, probe_activations: bool = True) -> DryRun:
    """Parallelize ``rank``'s stage modules for ``layout.world_size`` fake ranks; see the module docstring.

    Needs no process group (and refuses to run inside one): it creates the fake one and destroys it.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlike.models import spec_for
    from titanlike.parallel import ParallelDims
    from titanlike.parallel.parallelize import parallelize_model
    from titanlike.parallel.pipeline import build_stage

    if dist.is_initialized():
        raise RuntimeError("dry_run creates its own fake process group; call it outside torch.distributed")
    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        d = layout.dims  # plain degrees; the mesh comes from parallel's ParallelDims
        dims = ParallelDims(
            dp_replicate=d.dp_replicate,
            dp_shard=d.dp_shard,
            cp=d.cp,
            tp=d.tp,
            pp=d.pp,
            world_size=d.world_size,
            ep=d.ep,
        )
        dims.build_mesh("cpu")
        full = spec_for(args).build_meta(args)
        records = []
        for sid in layout.stage_ids(layout.pp_rank_of(rank)):
            names = layout.stages[sid]
            stage = build_stage(full, names)
            parallelize_model(stage, dims, cfg)
            for name, p in stage.named_parameters():
                shape, local, placements = _describe(p)
                records.append(ParamRecord(sid, name, shape, local, p.dtype, placements))
        result = DryRun(rank, layout.world_size, records, 0.0)
        if probe_activations:
            first = next(
                n
                for sid in layout.stage_ids(layout.pp_rank_of(rank))
                for n in layout.stages[sid]
                if n.startswith("layers.")
            )
            result.probe_layer = int(first.split(".")[1])
            result.block_activation_bytes = _probe_block(cfg, layout, args, dims, build_stage(full, [first]))
        result.seconds = time.perf_counter() - t0
        return result
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding propagation and redistribution plans by mesh *value* (shape, ranks, names), and the
    cached results hold the mesh objects, whose process groups are this fake group's: a later dry run in the same
    process for another rank (a mesh equal by value, its groups registered under other names) would reuse them and
    fail with "Could not resolve the process group" (measured, torch 2.13). Clear them with the group."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's copy
    if native is not None:
        native()


def _probe_block(cfg: JobConfig, layout: Layout, args, dims, block) -> int:
    """Activation bytes one block (a meta stage holding just that block) holds after its forward on one
    microbatch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from titanlike.layout import loss_parallel_enabled
    from titanlike.models import block_container_of
    from titanlike.models.moe import balanced_routing, set_aux_loss_denominator
    from titanlike.parallel.activation_checkpoint import apply_ac
    from titanlike.parallel.tensor_parallel import apply_tp

    if layout.tp > 1:
        apply_tp(
            block,
            dims.get_mesh("tp"),
            sequence_parallel=layout.sequence_parallel,
            loss_parallel=loss_parallel_enabled(cfg, layout.dims),
        )
    if layout.cp > 1:
        from titanlike.parallel.context_parallel import apply_cp

        apply_cp(block, dims.get_mesh("cp"), method=layout.cp_method, a2a_degree=layout.cp_a2a)
    if layout.ac_mode != "none":
        apply_ac(block, cfg.activation_checkpoint)
    act = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}[layout.dtype]
    seq = layout.local_seq_len // (layout.tp if layout.sequence_parallel else 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        block.to_empty(device="cpu")
        rope = torch.float64 if act == torch.float64 else torch.float32  # the model keeps its tables in fp32
        for name, p in list(block.named_parameters()):  # FSDP's mixed precision computes with bf16 copies
            owner, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(owner), leaf, torch.nn.Parameter(p.detach().to(act)))
        for name, buf in list(block.named_buffers()):  # RoPE tables (Llama): float32, or float64 for float64 runs
            owner, _, leaf = name.rpartition(".")
            block.get_submodule(owner)._buffers[leaf] = buf.to(rope)
        x_leaf = torch.empty(layout.microbatch_size, seq, args.dim, dtype=act, requires_grad=True)
        if layout.tp > 1:
            x_leaf = DTensor.from_local(
                x_leaf, dims.get_mesh("tp"), [Shard(1) if layout.sequence_parallel else Replicate()], run_check=False
            )
        # what the model hands every block besides the hidden states (RoPE rows of the position seam's positions):
        # made once per forward for all blocks, so not this block's activations
        kwargs = block.block_kwargs(block.positions(x_leaf))
        (layer,) = block_container_of(block).values()
        tracker = MemTracker()
        tracker.track_external(block, x_leaf, *kwargs.values())
        set_aux_loss_denominator(layer, layout.microbatch_size * layout.dp)  # a sequence-wise aux loss's global S
        # an MoE block routes round-robin: every expert the same rows (the planner's assumed balance), known from
        # the shapes, as FakeTensorMode needs
        with tracker, balanced_routing():
            x = x_leaf * 1  # the block input as the previous block hands it over: kept only if the block saves it
            y = layer(x, **kwargs)
            del x
            snapshot = tracker.get_tracker_snapshot("current")
        held = sum(v for dev in snapshot.values() for k, v in dev.items() if str(k).endswith("ACT"))
        out = y.to_local() if isinstance(y, DTensor) else y
        return held - out.numel() * out.element_size()
