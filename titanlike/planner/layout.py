"""A run's layout as the planner sees it: degrees, batch split, pipeline stages, and where each group lives.

Every decision is the layout layer's (``titanlike.layout``: degrees, rules, the pipeline split and placement, the
precision, reshard and activation-checkpointing policies, the batch split), the same functions the trainer and the
parallelize functions act on, so the plan prices the run that ``train.py`` would start, not a look-alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from titanlike.errors import ConfigError
from titanlike.layout import (
    FLATTENED,
    MESH_DIMS,
    TOKEN_DIMS,
    Degrees,
    ac_block_mode,
    batch_split,
    layout_violations,
    loss_parallel_enabled,
    master_dtype,
    precision_policy,
    reshard_after_forward,
    schedule_facts,
    stage_ids_for_rank,
    stage_module_names,
    virtual_dp_degree,
)
from titanlike.models import get_spec

__all__ = ["GroupMap", "Layout", "group_map"]

_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}


@cache
def fsdp_reduces_replicated_grads_wide() -> bool:
    """Whether this torch's FSDP2 gives a parameter it reduces outside the data-parallel dims (a tp-replicated norm
    weight, whose gradient is ``Partial`` over tp) its gradient in the reduce dtype, so that the tp all-reduce runs in
    float32 under mixed precision: torch 2.15 (measured; its ``FSDPParam.may_reduce_grad_outside_dp`` marks them);
    2.11 and 2.13 all-reduce it in the compute dtype (bf16)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return False
    return hasattr(FSDPParam, "may_reduce_grad_outside_dp")


@dataclass(frozen=True)
class Layout:
    """One configuration's parallel layout. Build with :meth:`from_config`; fields are plain numbers."""

    dims: Degrees
    gpus_per_node: int
    sequence_parallel: bool
    loss_parallel: bool
    schedule: str  # the pipeline schedule ("" without pipeline parallelism)
    stages: tuple[tuple[str, ...], ...]  # module names of every stage (one stage: the whole model)
    microbatch_size: int  # sequences per forward: the pp microbatch, or the local batch without pp
    n_microbatches: int  # forwards per schedule step (1 without pp)
    accum_steps: int  # forward-backward passes (schedule steps) per optimizer step
    seq_len: int
    global_batch: int  # sequences per optimizer step
    dtype: str  # training.dtype: float32 | bfloat16 (fp32 master weights, bf16 compute) | float64
    reshard_after_forward: str  # default | always | never
    ac_mode: str  # none | full | selective
    ac_option: str  # selective: "op" or every N-th block
    loss_chunk_size: int
    optimizer: str = "AdamW"  # optimizer.name: AdamW | Muon
    ns_dtype: str = "bfloat16"  # Muon's Newton-Schulz precision
    ns_steps: int = 5  # Muon's Newton-Schulz iterations
    muon_bucket_mb: float = 128.0  # Muon's full-matrix megabytes per pair of all-to-alls
    # The share of the causal mask's attention computed: 1 under model.attn_mask_type = causal; under block_causal
    # the tiles the corpus's documents keep (titanlike.data.documents.document_stats: block_fraction)
    attention_fraction: float = 1.0
    # Mixture of experts: the load the planner assumes on the busiest expert-parallel rank, as a multiple of the
    # mean (1: perfectly balanced, what the bias balancing steers to); scales that rank's all-to-all bytes and its
    # expert FLOPs
    expert_imbalance: float = 1.0
    # parallelism.expert_dispatch: "padded" moves and computes every expert's worst-case buffer (experts x the rank's
    # tokens rows per MoE layer, whatever the load) instead of the routed rows
    expert_dispatch: str = "uneven"
    # parallelism.context_parallel_method (allgather | alltoall | ring | hybrid), hybrid's all-to-all group size
    # (parallelism.context_parallel_a2a_degree) and whether attention masks documents (block_causal: the all-to-all
    # method gathers the document starts once per forward)
    cp_method: str = "allgather"
    cp_a2a: int = 1
    documents: bool = False
    # memory modes: ZeRO-1 (parallelism.distributed_optimizer), FSDP's CPU offload (training.enable_cpu_offload),
    # activation offload (activation_checkpoint.offload)
    distributed_optimizer: bool = False
    cpu_offload: bool = False
    act_offload: bool = False

    @classmethod
    def from_config(
        cls,
        cfg,
        world_size: int,
        args,
        gpus_per_node: int,
        attention_fraction: float = 1.0,
        expert_imbalance: float = 1.0,
    ) -> Layout:
        """The layout of ``cfg`` on ``world_size`` ranks; ConfigError if the layout itself is illegal.
        ``attention_fraction``: the block-causal mask's share of the causal attention (1 for ``causal``);
        ``expert_imbalance``: the busiest expert-parallel rank's load over the mean (>= 1)."""
        problems = layout_violations(cfg, world_size, args)
        if problems:
            raise ConfigError.of(problems)
        if not 0 < attention_fraction <= 1 or (cfg.model.attn_mask_type == "causal" and attention_fraction != 1):
            raise ConfigError(
                f"attention fraction {attention_fraction}: the share of causal attention a mask computes is in (0, 1], "
                f"and 1 under model.attn_mask_type = causal"
            )
        if not expert_imbalance >= 1:
            raise ConfigError(
                f"expert imbalance {expert_imbalance}: the busiest expert-parallel rank's load over the mean is >= 1"
            )
        p, t = cfg.parallelism, cfg.training
        dims = Degrees.from_config(cfg, world_size)
        pp = dims.pp > 1
        spec = get_spec(cfg.model.name)
        stages = (
            tuple(tuple(s) for s in stage_module_names(cfg, args))
            if pp
            else (
                spec.input_modules
                + tuple(f"{spec.block_container}.{i}" for i in range(args.n_layers))
                + spec.output_modules,
            )
        )
        split = batch_split(t.global_batch_size, t.local_batch_size, dims.dp, virtual_dp_degree(t))
        return cls(
            dims=dims,
            gpus_per_node=gpus_per_node,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=loss_parallel_enabled(cfg, dims),
            schedule=p.pipeline_parallel_schedule if pp else "",
            stages=stages,
            microbatch_size=p.pipeline_parallel_microbatch_size if pp else split.local_batch,
            n_microbatches=split.local_batch // p.pipeline_parallel_microbatch_size if pp else 1,
            accum_steps=split.accum_steps,
            seq_len=t.seq_len,
            global_batch=split.global_batch,
            dtype=t.dtype,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            ac_mode=cfg.activation_checkpoint.mode,
            ac_option=cfg.activation_checkpoint.selective_ac_option,
            loss_chunk_size=p.loss_chunk_size,
            optimizer=cfg.optimizer.name,
            ns_dtype=cfg.optimizer.ns_dtype,
            ns_steps=cfg.optimizer.ns_steps,
            muon_bucket_mb=cfg.optimizer.muon_bucket_mb,
            attention_fraction=attention_fraction,
            expert_imbalance=expert_imbalance,
            expert_dispatch=p.expert_dispatch,
            cp_method=p.context_parallel_method,
            cp_a2a=p.context_parallel_a2a_degree,
            documents=cfg.model.attn_mask_type == "block_causal",
            distributed_optimizer=p.distributed_optimizer,
            cpu_offload=t.enable_cpu_offload,
            act_offload=cfg.activation_checkpoint.offload,
        )

    # ----------------------------------------------------------------------------------------- degrees
    # The degrees, read through from ``dims``.
    world_size = property(lambda self: self.dims.world_size)
    tp = property(lambda self: self.dims.tp)
    pp = property(lambda self: self.dims.pp)
    dp_shard = property(lambda self: self.dims.dp_shard)
    dp_replicate = property(lambda self: self.dims.dp_replicate)
    dp = property(lambda self: self.dims.dp)

    @property
    def cp(self) -> int:
        return self.dims.cp

    ep = property(lambda self: self.dims.ep)
    ep_tp = property(lambda self: self.dims.ep_tp)
    dp_shard_mod_ep = property(lambda self: self.dims.dp_shard_mod_ep)

    def token_index(self, coords: dict[str, int]) -> int:
        """A rank's place among the ranks routing tokens of their own (``dp_shard x cp``, ``x tp`` when expert
        parallelism borrows tp): ``ep`` cuts them into consecutive blocks (ep innermost, as ``ParallelDims``)."""
        i = self.fsdp_shard_index(coords)
        return i * self.tp + coords["tp"] if self.ep_tp > 1 else i

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on one rank: ``seq_len / cp`` (two load-balanced chunks)."""
        return self.seq_len // self.dims.cp

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard x cp."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def fsdp_dim(self) -> str:
        """The mesh dim name of FSDP's shard group ("dp_shard", or the flattened "dp_shard_cp" under cp)."""
        return "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"

    def fsdp_shard_index(self, coords: dict[str, int]) -> int:
        return coords["dp_shard"] * self.dims.cp + coords["cp"]

    @property
    def n_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.pp

    @property
    def fsdp(self) -> bool:
        """Parameters live in FSDP2 groups (sharded, or HSDP with a shard group of one)."""
        return self.dims.fsdp_wraps

    @property
    def precision(self) -> str:
        """ "fsdp" (FSDP mixed precision), "autocast" or "none": ``titanlike.layout.precision_policy``."""
        return precision_policy(self.dtype, self.dims)

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "none"

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the stored (master) parameters, their gradients and AdamW states."""
        return _BYTES[master_dtype(self.dtype)]

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations (bf16 under mixed precision) and of FSDP's gathered parameters."""
        return _BYTES[self.dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of FSDP's gradient reduce-scatter (float32 under mixed precision)."""
        return self.param_bytes

    @property
    def replicated_grad_bytes(self) -> int:
        """Bytes per element of a tp-replicated weight's gradient, all-reduced over tp (a norm's under SP, a per-head
        norm's): the stored dtype without FSDP; under FSDP the compute dtype, or the reduce dtype where FSDP has
        autograd upcast it (:func:`fsdp_reduces_replicated_grads_wide`)."""
        if not self.fsdp:
            return self.param_bytes
        return self.reduce_bytes if fsdp_reduces_replicated_grads_wide() else self.act_bytes

    @property
    def ns_bytes(self) -> int:
        """Bytes per element of Muon's gathered and orthogonalized matrices (its Newton-Schulz dtype)."""
        return _BYTES[self.ns_dtype]

    @property
    def compute_bytes(self) -> int:
        """Norms, RoPE and the loss compute in at least float32."""
        return 8 if self.dtype == "float64" else 4

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def reshard(self, group: str) -> bool:
        """Does FSDP free the gathered parameters of ``group`` ("block", "embedding", "head", "root") after its
        forward? ``titanlike.layout.reshard_after_forward``, which ``apply_fsdp`` applies."""
        return reshard_after_forward(self.reshard_after_forward, group, self.pp > 1)

    def checkpointed(self, layer_id: int) -> str:
        """How block ``layer_id`` is checkpointed: "none", "full" or "op" (``titanlike.layout.ac_block_mode``)."""
        return ac_block_mode(self.ac_mode, self.ac_option, layer_id)

    # ----------------------------------------------------------------------------------------- stages
    def stage_ids(self, pp_rank: int) -> list[int]:
        return stage_ids_for_rank(pp_rank, self.pp, len(self.stages), self.schedule or "1F1B")

    def pp_rank_of(self, rank: int) -> int:
        return self.dims.pp_rank_of(rank)

    def coords(self, rank: int) -> dict[str, int]:
        return self.dims.coords(rank)

    @property
    def v_placement(self) -> bool:
        return bool(self.schedule) and schedule_facts(self.schedule).v_placement

    # ----------------------------------------------------------------------------------------- the grid
    @cached_property
    def groups(self) -> dict[str, GroupMap]:
        """tp, cp, dp_shard, dp_replicate, dp and pp groups against node boundaries."""
        groups = {
            name: group_map(self.dims, name, self.gpus_per_node)
            for name in ("tp", "cp", "dp_shard", "dp_shard_cp", "dp_replicate", "dp", "pp")
        }
        # Muon's all-to-alls: every rank of a pipeline stage (its matrices' flattened mesh)
        groups["muon"] = group_map(self.dims, "muon", self.gpus_per_node, members=MESH_DIMS[1:])
        for name, rows in self.expert_rows.items():
            groups[name] = _map_rows(name, rows, self.gpus_per_node)
        if self.ep_tp > 1:
            groups["cp_tp"] = group_map(self.dims, "cp_tp", self.gpus_per_node, members=("cp", "tp"))
        load = self.dims.expert_load_dim  # an MoE model's per-step expert loads and aux-loss terms
        if load is not None:
            groups[load] = group_map(self.dims, load, self.gpus_per_node, members=TOKEN_DIMS[load])
        return groups

    @cached_property
    def expert_rows(self) -> dict[str, np.ndarray]:
        """Under expert parallelism, the groups (rows of ranks) of ``ep`` (the token ranks cut into blocks, ep
        innermost, as ``ParallelDims`` unflattens them), ``dp_shard_mod_ep`` (the same experts across the blocks) and,
        when ep borrows tp, ``dp_shard_cp_tp`` (every token rank of a model copy)."""
        if self.ep == 1:
            return {}
        rows = _group_rows(self.dims, ("dp_shard", "cp", "tp") if self.ep_tp > 1 else ("dp_shard", "cp"))
        m = rows.shape[1] // self.ep
        out = {
            "ep": rows.reshape(-1, self.ep),
            "dp_shard_mod_ep": rows.reshape(-1, m, self.ep).transpose(0, 2, 1).reshape(-1, m),
        }
        if self.ep_tp > 1:
            out["dp_shard_cp_tp"] = rows
        return out


@dataclass(frozen=True)
class GroupMap:
    """The groups of one mesh dim (or flattened dims) on the node grid."""

    name: str
    size: int
    n_groups: int
    stride: int  # rank distance between consecutive members
    spanning: tuple[tuple[int, ...], ...]  # groups whose members sit on more than one node
    max_nodes: int  # most nodes one group touches
    example: tuple[int, ...]  # the group of rank 0

    @property
    def crosses_nodes(self) -> bool:
        return bool(self.spanning)

    @property
    def link(self) -> str:
        if self.size == 1:
            return "-"
        if not self.spanning:
            return "nvlink"
        return "network" if len(self.spanning) == self.n_groups else f"network ({len(self.spanning)}/{self.n_groups})"


def group_map(dims: Degrees, name: str, gpus_per_node: int, members: tuple[str, ...] | None = None) -> GroupMap:
    """Where the groups of mesh dim ``name`` ("tp", "dp", ...; or of the dims ``members``) sit: the same groups as
    ``titanlike.layout.rank_groups``, computed with numpy so that 16k-rank grids take milliseconds."""
    return _map_rows(name, _group_rows(dims, members or FLATTENED.get(name, (name,))), gpus_per_node)


def _group_rows(dims: Degrees, members: tuple[str, ...]) -> np.ndarray:
    """(groups, size): the ranks of every group of the dims ``members``, each row in mesh order."""
    axes = [MESH_DIMS.index(m) for m in members]
    grid = np.arange(dims.world_size).reshape(dims.shape)
    rest = [a for a in range(len(MESH_DIMS)) if a not in axes]
    return np.transpose(grid, rest + axes).reshape(-1, int(np.prod([dims.shape[a] for a in axes])))


def _map_rows(name: str, groups: np.ndarray, gpus_per_node: int) -> GroupMap:
    size = groups.shape[1]
    nodes = groups // gpus_per_node
    crossing = nodes.min(axis=1) != nodes.max(axis=1)
    spanning = tuple(tuple(int(r) for r in g) for g in groups[crossing])
    max_nodes = max(len(np.unique(row)) for row in nodes[crossing]) if crossing.any() else 1
    stride = int(groups[0, 1] - groups[0, 0]) if size > 1 else 0
    return GroupMap(
        name=name,
        size=size,
        n_groups=groups.shape[0],
        stride=stride,
        spanning=spanning if size > 1 else (),
        max_nodes=max_nodes,
        example=tuple(int(r) for r in groups[0]),
    )
