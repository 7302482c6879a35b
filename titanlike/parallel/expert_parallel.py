"""Expert parallelism: the MoE block's routed experts sharded over an ``ep`` mesh, tokens moved by all-to-all.

Applied from outside to the plain block of ``titanlike.models.moe`` (which imports nothing of torch.distributed),
like every other style: ``apply_ep(model, ep_mesh)`` puts :class:`ExpertParallel` on every ``GroupedExperts``.

**Weights.** ``w1``, ``w2``, ``w3`` become DTensors ``Shard(0)`` over the 1-D ``ep`` mesh: ep rank ``r`` holds experts
``r * E/ep ... (r + 1) * E/ep - 1`` (``E % ep == 0``, refused otherwise). ``full_tensor()``, checkpoints and the
sharded init (``titanlike.init``: each rank generates only its experts) see the single-device tensors.

**Tokens** (the style's input / output hooks around ``GroupedExperts.forward(x_sorted, counts)``, x sorted by global
expert id, ``counts[e]`` rows for expert ``e``):

1. *counts exchange*: one ``all_to_all_single`` of ``counts`` (E integers, equal splits): rank ``r`` receives, from
   every ep rank ``p``, how many of ``p``'s rows go to each of its local experts (a ``(ep, E/ep)`` matrix), and both
   split lists follow (the rows sent to each rank, received from each rank): one host synchronisation. The one pair
   a rank can check alone, its rows to itself, must agree with the exchange, else the dispatch refuses (gloo
   enforces the same pair; NCCL would move misaddressed rows);
2. *dispatch*: ``all_to_all_single`` (autograd) of the rows with those uneven splits (any split may be 0), then a
   local regrouping from (source rank, local expert) order to (local expert, source rank) order, so each local
   expert's rows are contiguous for the grouped / looped matmul;
3. *combine*: the inverse regrouping and the reverse ``all_to_all_single`` (splits swapped): every row returns to
   the rank and position it came from, and the block combines it with its routing weight there.

So one MoE layer costs **3 all-to-alls forward (counts, dispatch, combine) and 2 backward** (the transposes of the
dispatch and the combine: autograd's ``all_to_all_single`` backward is the all-to-all with the splits swapped),
pinned by ``CommDebugMode`` in tests/parallel/test_expert_parallel.py.

**The padded dispatch** (``GroupedExperts.dispatch == "padded"``, ``titanlike.models.moe.set_expert_dispatch``,
``parallelism.expert_dispatch``): the block hands over a zero-padded ``(experts x capacity, dim)`` buffer, expert-major
with a static capacity (the rank's tokens: dropless); one equal-split all-to-all of the whole buffer sends each ep rank
its experts' slices, a static transpose turns the (source rank, local expert) blocks into (local expert, source
rank) order, and the combine is the inverse transpose and the all-to-all back: **2 all-to-alls forward, 2 backward**,
no counts exchange, no host read, every shape static (CUDA-graph friendly), at ``experts / top_k`` times the bytes.

**Gradients.** A rank's expert shard gets its gradient from the rows it computed, i.e. from every token routed to
its experts from every ep rank: the sum over the ep group happens in the all-to-all backward, with no reduction
of the weights themselves. When ep borrows ranks from data parallelism (torchtitan's rule: ``ep`` divides
``dp_shard * cp`` (``* tp`` under sequence parallelism)), the ranks of one ep group hold different data; the
non-expert parameters (router, shared experts, attention, embeddings) stay data-parallel as today (FSDP sums their
gradients over ``dp_shard * cp``). The ranks holding the *same* experts (same ep coordinate) form the remaining
``dp_shard_mod_ep = dp_shard * cp / ep`` ranks; they saw different tokens, so their expert gradients must be
summed across them: :func:`apply_expert_fsdp` shards each ``GroupedExperts`` with FSDP2 over that mesh (its own
group, so the enclosing block's FSDP group leaves the experts alone), with gradients **summed** like every other FSDP
group here (the loss is already divided by the global token count). FSDP2 needs that mesh and the ep mesh to be
slices of one root mesh (``root["dp_shard_mod_ep", "ep"]``: the expert weights become 2-D DTensors); it shards on
dim 0 (whole experts per rank) when the local experts divide by its size, else on dim 1 (torchtitan's choice when
``dp_shard_mod_ep * ep > E``). Under HSDP the expert mesh is 2-D ``(dp_replicate, dp_shard_mod_ep)``, the replicas
all-reducing as usual. A size-1 ``dp_shard_mod_ep`` (ep = the whole data group) still gets its group: otherwise
the block's FSDP group would shard the experts over the data ranks a second time.

**Load balancing across ranks.** :func:`sync_expert_biases` all-reduces every layer's tokens per expert (one
all-reduce for all layers) over the ranks that saw other tokens (the data-parallel x context-parallel group of the
stage) before the bias update: the biases stay identical on every rank and follow the *global* batch.
:func:`set_aux_sequence_group` gives the sequence-wise auxiliary loss the per-sequence counts of the whole sequence
when sequences are split over ranks (context parallelism; see ``titanlike.models.moe``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titanlike.models.moe import (
    GroupedExperts,
    MoE,
    aux_losses,
    expert_loads,
    moe_modules,
    reset_moe_stats,
    set_aux_loss_denominator,
    update_expert_biases,
)
from titanlike.parallel.fsdp import _sum_gradients
from titanlike.sharding import local_tensor

__all__ = [
    "ExpertParallel",
    "apply_ep",
    "apply_expert_fsdp",
    "experts_modules",
    "expert_fsdp_dim",
    "expert_fsdp_placement",
    "sync_expert_biases",
    "set_aux_sequence_group",
    "regroup_order",
    "ExpertBalancing",
]


def regroup_order(counts: Tensor, total: int | None = None) -> Tensor:
    """Row order that turns blocks laid out by (source rank p, local expert l) into (l, p) order.

    ``counts`` (ep, local experts): rows per block, blocks contiguous in row-major (p, l) order; ``total``: their sum
    if the caller knows it on the host (no device synchronisation then). Returns the indices ``i`` such that ``x[i]``
    lists every local expert's rows contiguously (from rank 0's first)."""
    ep, local = counts.shape
    counts = counts.to(torch.int64)
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(ep, local)
    sizes_t, starts_t = counts.t().reshape(-1), starts.t().reshape(-1)
    total = int(counts.sum()) if total is None else total
    block = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), sizes_t, output_size=total)
    within = torch.arange(total, device=counts.device) - (sizes_t.cumsum(0) - sizes_t)[block]
    return starts_t[block] + within


def _swap_blocks(x: Tensor, outer: int, inner: int) -> Tensor:
    """Rows laid out as (outer, inner, r) blocks reordered to (inner, outer, r) (a static transpose, no index)."""
    return x.view(outer, inner, x.shape[0] // (outer * inner), x.shape[-1]).transpose(0, 1).reshape(x.shape)


def _inverse(order: Tensor) -> Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class ExpertParallel(ParallelStyle):
    """The style for one ``GroupedExperts`` over a 1-D ``ep`` mesh (module docstring). Keeps the splits of the
    forward in flight between its dispatch and its combine (one style instance per module: :func:`apply_ep`)."""

    def __init__(self):
        super().__init__()
        self._pending: list[tuple[list[int], list[int], Tensor]] = []

    @staticmethod
    def _partition_fn(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

    def _exchange_counts(self, counts: Tensor, mesh: DeviceMesh) -> Tensor:
        """(ep, local experts): how many rows each ep rank sends to each of this rank's experts."""
        with torch.no_grad():
            got = funcol.all_to_all_single(counts.to(torch.int64), None, None, mesh)
            return funcol.wait_tensor(got).view(mesh.size(), -1)

    def _dispatch(self, module: nn.Module, inputs, mesh: DeviceMesh):
        x, counts = inputs
        ep = mesh.size()
        if counts.numel() % ep:
            raise ValueError(f"ExpertParallel: {counts.numel()} experts do not divide over ep {ep}")
        if module.dispatch == "padded":
            return self._dispatch_padded(x, counts, mesh)
        received = self._exchange_counts(counts, mesh)
        send = counts.view(ep, -1).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        me = mesh.get_local_rank()
        if send[me] != recv[me]:  # the one pair this rank can check alone: its rows to itself
            raise RuntimeError(
                f"ExpertParallel: ep rank {me} sends {send[me]} rows to itself but the exchanged counts say "
                f"{recv[me]} (split sizes not from this forward's counts)"
            )
        x = funcol.all_to_all_single_autograd(x, recv, send, mesh)
        order = regroup_order(received, sum(recv))
        self._pending.append((send, recv, order))
        return x.index_select(0, order), received.sum(dim=0)

    @staticmethod
    def _dispatch_padded(x: Tensor, counts: Tensor, mesh: DeviceMesh):
        """The padded dispatch: ``x`` is (experts x capacity, dim), expert-major; one equal-split all-to-all sends
        each ep rank its experts' slices, and the received (source rank, local expert) blocks are regrouped to
        (local expert, source rank) so each local expert's ``ep x capacity`` rows are contiguous."""
        ep, local = mesh.size(), counts.numel() // mesh.size()
        got = funcol.all_to_all_single_autograd(x.contiguous(), None, None, mesh)
        return _swap_blocks(got, ep, local), counts

    def _combine(self, module: nn.Module, out: Tensor, mesh: DeviceMesh) -> Tensor:
        if module.dispatch == "padded":  # the inverse regrouping, then the all-to-all back (equal splits)
            back = _swap_blocks(out, module.num_experts // mesh.size(), mesh.size())
            return funcol.all_to_all_single_autograd(back.contiguous(), None, None, mesh)
        send, recv, order = self._pending.pop()
        out = out.index_select(0, _inverse(order))
        return funcol.all_to_all_single_autograd(out, send, recv, mesh)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, mesh, self._partition_fn, input_fn=self._dispatch, output_fn=self._combine)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def experts_modules(model: nn.Module) -> list[tuple[str, GroupedExperts]]:
    """(FQN, module) of every ``GroupedExperts`` of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Expert parallelism over the 1-D ``ep_mesh`` on every ``GroupedExperts`` of ``model``, in place; returns it.

    Refuses, in one message, a mesh that is not 1-D, a model without experts (a silent no-op), a number of
    experts that ``ep`` does not divide (every such module named), and experts already sharded. Works on the meta
    device (build, apply, then allocate and initialise: ``titanlike.init``)."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D expert-parallel mesh, got {ep_mesh.ndim}-D {ep_mesh}; pass mesh['ep']")
    found = experts_modules(model)
    if not found:
        raise ValueError(
            f"apply_ep: {type(model).__name__} has no GroupedExperts module (titanlike.models.moe.MoE), so expert "
            f"parallelism would do nothing"
        )
    ep = ep_mesh.size()
    problems = [f"'{n}' has {m.num_experts} experts, not divisible by ep {ep}" for n, m in found if m.num_experts % ep]
    problems += [f"'{n}' is already sharded (apply_ep twice?)" for n, m in found if isinstance(m.w1, DTensor)]
    if problems:
        raise ValueError("apply_ep: " + "; ".join(problems))
    for _, m in found:
        ExpertParallel()._apply(m, ep_mesh)
    return model


def expert_fsdp_dim(local_experts: int, mesh_size: int) -> int:
    """The dim FSDP shards a routed expert weight on over ``mesh_size`` ranks: 0 (whole experts per rank) when this
    rank's ``local_experts`` divide by it, else 1 (an expert's rows split over the ranks). The planner reads it too."""
    return 0 if local_experts % mesh_size == 0 else 1


def expert_fsdp_placement(experts: GroupedExperts, mesh_size: int) -> Shard:
    """FSDP's placement for one expert weight over ``mesh_size`` ranks (:func:`expert_fsdp_dim`)."""
    return Shard(expert_fsdp_dim(_local_experts(experts), mesh_size))


def _local_experts(experts: GroupedExperts) -> int:
    w = experts.w1
    return w.to_local().shape[0] if isinstance(w, DTensor) else w.shape[0]


def apply_expert_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 on every ``GroupedExperts`` of ``model`` over ``mesh``, the ranks holding the same experts
    (``dp_shard_mod_ep``; 2-D ``(dp_replicate, dp_shard_mod_ep)`` for HSDP), gradients **summed**. Call it after
    :func:`apply_ep` and before ``apply_fsdp`` on the blocks, so each expert module is its own FSDP group (module
    docstring). Expert weights sharded by :func:`apply_ep` must come from the same root mesh as ``mesh``."""
    found = experts_modules(model)
    if not found:
        raise ValueError(f"apply_expert_fsdp: {type(model).__name__} has no GroupedExperts module")
    size = mesh.size(mesh.ndim - 1)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for _, m in found:
        placement = expert_fsdp_placement(m, size)
        _summed_fsdp(m, mesh, mp, reshard_after_forward, lambda p, placement=placement: placement)
    return model


def _summed_fsdp(module: nn.Module, mesh: DeviceMesh, mp, reshard_after_forward, placement_fn=None) -> None:
    fully_shard(
        module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement_fn
    )
    _sum_gradients(module)


def apply_moe_token_fsdp(model: nn.Module, mesh: DeviceMesh, **fsdp) -> nn.Module:
    """FSDP2 on every MoE block of ``model`` over ``mesh`` (``ParallelDims.moe_token_mesh``: dp_shard x cp x tp),
    gradients **summed**: when expert parallelism borrows the tp ranks every one of them routes tokens of its own,
    so the router's and the shared experts' gradients are sums over all of them. Call it after
    :func:`apply_expert_fsdp` (the experts keep their own groups) and before ``apply_fsdp`` on the blocks; ``fsdp``:
    ``param_dtype``, ``reduce_dtype``, ``reshard_after_forward`` as for :func:`apply_expert_fsdp`."""
    blocks = moe_modules(model)
    if not blocks:
        raise ValueError(f"apply_moe_token_fsdp: {type(model).__name__} has no MoE block")
    mp = MixedPrecisionPolicy(param_dtype=fsdp.get("param_dtype"), reduce_dtype=fsdp.get("reduce_dtype"))
    for m in blocks:
        _summed_fsdp(m, mesh, mp, fsdp.get("reshard_after_forward", True))
    return model


def _all_reduce_sum(values: Tensor, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


def _all_reduce_loads(loads: Tensor, group) -> Tensor:
    """The tokens per expert summed over ``group`` (the one place the bias update's loads become global)."""
    return _all_reduce_sum(loads, group)


def sync_expert_biases(model: nn.Module, group=None) -> Tensor:
    """After the optimizer step: this rank's tokens per expert (:func:`titanlike.models.moe.expert_loads`) summed
    over ``group`` (the ranks that saw other tokens: data-parallel x context-parallel; one all-reduce for all
    layers), then every bias updated from those global loads. Returns the global loads (layers, experts) for the
    metrics; the caller resets the counters (``titanlike.models.moe.reset_moe_stats``)."""
    loads = _all_reduce_loads(expert_loads(model).clone(), group)
    update_expert_biases(model, loads)
    return loads


def set_aux_sequence_group(model: nn.Module, group) -> None:
    """Sequences split over ``group`` (context parallelism): the sequence-wise aux loss sums each sequence's expert
    counts over it (a small all-reduce per MoE layer forward), so every rank sees the whole sequence's counts."""

    def reduce(counts: Tensor) -> Tensor:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        return counts

    fn: Callable[[Tensor], Tensor] | None = reduce if group is not None and dist.get_world_size(group) > 1 else None
    for m in moe_modules(model):
        m.aux_counts_reduce = fn


class ExpertBalancing:
    """The training loop's side of the MoE blocks, once per optimizer step (``train_step(..., moe=...)``; built by
    ``build_parallel_model`` for a model with MoE blocks, so the trainer, the gate and the benchmark run the same):

    * :meth:`begin_step`: the sequence-wise aux loss's denominator, the **global** batch's sequences (this rank's
      micro-batch rows x ``dp``: every data-parallel rank holds as many; context-parallel ranks hold pieces of the
      same sequences, so cp does not multiply);
    * :meth:`end_step`: after the optimizer step, the tokens per expert summed over ``group`` (dp x cp: every rank
      that saw other tokens; one all-reduce for all layers) and every bias updated from those global loads
      (:func:`sync_expert_biases`; not after a skipped step), the aux-loss contributions summed over ``group`` for
      the log, then the counters reset. Returns ``{"aux_loss": per-layer sum, "loads": (layers, experts)}``, one row
      per MoE block of the whole model in module order (``layers``: their FQNs; default: those of ``model_parts``).

    Under pipeline parallelism ``model_parts`` are this rank's stages (a stage may hold no MoE block: its ranks
    update nothing) and ``layers`` the FQNs of every MoE block of the full model; each stage's ranks update their own
    blocks' biases over their own dp x cp group (the other stages' blocks are other parameters), and the rows for
    the log are summed over ``pp_group`` (each row is filled by the one pp rank holding that block: one small
    all-reduce per step), so every rank logs the whole model's loads.
    """

    def __init__(self, model_parts: list[nn.Module], group, dp: int, *, layers=None, num_experts=0, pp_group=None):
        self.model_parts, self.group, self.dp, self.pp_group = model_parts, group, dp, pp_group
        held = [n for m in model_parts for n, mod in m.named_modules() if isinstance(mod, MoE)]
        self.layers = list(layers) if layers is not None else held
        self.num_experts = num_experts or next(mod.args.num_experts for m in model_parts for mod in moe_modules(m))
        missing = sorted(set(held) - set(self.layers))
        if missing:
            raise ValueError(f"ExpertBalancing: MoE blocks {missing} are not among the model's layers {self.layers}")

    def begin_step(self, micro_batches) -> None:
        sequences = sum(int(batch[0].shape[0]) for batch in micro_batches) * self.dp  # (inputs, labels[, starts])
        for m in self.model_parts:
            set_aux_loss_denominator(m, sequences)

    def end_step(self, skipped: Tensor | None = None) -> dict:
        """The biases updated from the global loads (kept as they were where the device flag ``skipped`` is set: a
        skipped step moves no bias, decided without a host read), the aux losses and loads for the log."""
        parts = [m for m in self.model_parts if moe_modules(m)]
        rows = [self.layers.index(n) for m in parts for n, mod in m.named_modules() if isinstance(mod, MoE)]
        if parts:
            aux = torch.cat([aux_losses(m) for m in parts])
            aux = _all_reduce_sum(aux, self.group)
            with torch.no_grad():  # the DTensors' own local tensors, written in place below
                biases = (
                    []
                    if skipped is None
                    else [
                        local_tensor(mod.expert_bias)
                        for m in parts
                        for mod in moe_modules(m)
                        if mod.expert_bias is not None
                    ]
                )
            before = [b.clone() for b in biases]
            loads = torch.cat([sync_expert_biases(m, self.group) for m in parts])
            with torch.no_grad():
                for b, kept in zip(biases, before):
                    torch.where(skipped.to(device=b.device, dtype=torch.bool), kept, b, out=b)
            for m in parts:
                reset_moe_stats(m)
        if self.pp_group is None:
            return {"aux_loss": aux, "loads": loads}  # on the device: read when the trainer logs them
        # every stage's rows into one (layers, 1 + experts) table, summed over the pipeline (one row per pp rank)
        device = next(t for m in self.model_parts for t in (*m.parameters(), *m.buffers())).device
        table = torch.zeros(len(self.layers), 1 + self.num_experts, dtype=torch.float64, device=device)
        if parts:
            table[rows, 0] = aux.to(torch.float64).to(device)
            table[rows, 1:] = loads.to(torch.float64).to(device)
        dist.all_reduce(table, group=self.pp_group)
        return {"aux_loss": table[:, 0], "loads": table[:, 1:].round().to(torch.int64)}
