"""Tensor (+ sequence) parallelism, Megatron-style, applied from outside with DTensor ``ParallelStyle`` s.

A registered model declares how its modules split as plain data (``titanlike.sharding`` entries, in
``titanlike/models/<name>/sharding.py``); :func:`tp_plan` is the one translator of such entries into torch (or
torchao float8) ``ParallelStyle`` s, and :func:`apply_tp` applies a plan with ``parallelize_module``: the model's
own (``plan=None``) or any ``{module-path pattern: ParallelStyle}`` a user writes for their own module.

The translation (``seq`` = ``Shard(1)`` under sequence parallelism, else ``Replicate()``):

=====================  ==========================================================================================
``VocabEmbedding``     RowwiseParallel: vocab-sharded table, output ``seq`` (all-reduce, or reduce-scatter under SP)
``PositionTable``      :class:`PositionEmbeddingParallel`: replicated table, output in the stream's layout
``Norm``               SP: :class:`StreamParallel` (SequenceParallel: the local sequence shard, weight replicated); else
                       :class:`ReplicateParallel` (runs on the replicated stream, returns a local tensor)
``HeadNorm``           SequenceParallel over the heads dim: runs on this rank's heads, weight replicated, its
                       gradient a ``Partial`` sum over tp (never ReplicateParallel: each rank sees other heads)
``Latent``             :class:`LatentParallel`: replicated weight on the region's replicated input (MLA's latent
                       down-projections and norms), its gradient a ``Partial`` sum over tp; ``local_output``:
                       its output as the local tensor (a partial gradient)
``HeadParams``         :class:`HeadParamsParallel`: parameters ``Shard(0)`` with the heads, inputs this rank's
                       shards along the heads dim, outputs local (attention sinks, a linear-attention decay, its
                       conv's channels)
``Region``             PrepareModuleInput ``seq`` -> Replicate of the first input (keyword arguments untouched):
                       the "f" operator, identity forward / all-reduce backward (SP: all-gather / reduce-scatter);
                       ``Region(keyword=k)``: of keyword argument ``k`` instead, positional inputs untouched
``Colwise``            ColwiseParallel: output-feature shards, local heads / hidden units
``FusedColwise``       :class:`~titanlike.parallel.fused.FusedColwiseParallel`: each rank its slice of every chunk
``Rowwise``            RowwiseParallel, output ``seq``: the "g" operator, all-reduce forward (SP: reduce-scatter)
``Head``               ColwiseParallel from ``seq``: logits stay a DTensor ``Shard(-1)`` for the vocab-parallel
                       loss, or are all-gathered (``loss_parallel=False``)
``TokenLocal``         SP only: :class:`TokenLocalParallel`: runs on the local shard of the stream, returns it as
                       ``Shard(1)``; its parameters are left to a data-parallel reduction over tp (an MoE block)
=====================  ==========================================================================================

One transformer block therefore costs two all-reduces forward and two backward (SP: an all-gather and a
reduce-scatter in each direction instead of each all-reduce, same bytes, plus the all-reduce of the two norm
weight gradients, each rank having seen a different part of the sequence). The embedding and the Rowwise
projections return DTensors (``use_local_output=False``), so the residual stream between blocks is a DTensor:
per-block ``torch.compile`` needs that, and SP needs it to know the stream is sharded. ``float8=True`` (every
float8-eligible projection is a tensorwise torchao ``Float8Linear``): torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput`` for the float8 entries and their regions, as torchtitan
does: the activation is cast to float8 before the all-gather (SP) and the output gradient in the backward.

Every parameter of the parallelized model is a DTensor (norm weights ``Replicate``): one foreach optimizer
step handles them all (it refuses a mix of DTensors and plain tensors), and checkpoints see one kind.

Tied embeddings: RowwiseParallel on the embedding and ColwiseParallel on the head both shard the shared
(vocab, dim) weight as ``Shard(0)``; :func:`apply_tp` re-ties them so the model keeps ONE parameter.
Rotary tables are root buffers, untouched. Gradients of replicated DTensor parameters (SP norm weights)
come out of autograd as ``Partial`` sums; a hook reduces them right away so every gradient has its
parameter's placements (clipping, optimizer and checkpoints see ordinary gradients).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlike import sharding as sh
from titanlike.parallel.dtensor_grad import from_local
from titanlike.parallel.fused import FusedColwiseParallel
from titanlike.parallel.replica_check import ReplicaCheck, name_checks
from titanlike.parallel.ties import retie, tie_groups

__all__ = [
    "tp_plan",
    "apply_tp",
    "HeadNormParallel",
    "HeadParamsParallel",
    "LatentParallel",
    "ReplicateParallel",
    "PositionEmbeddingParallel",
    "StreamParallel",
    "TokenLocalParallel",
]


NORM_ADVICE = (
    "a norm over each rank's own heads (per-head q/k norms) needs HeadNormParallel(heads_dim=<the heads dim of its "
    "input>), a norm on a sequence shard SequenceParallel(); ReplicateParallel only suits a module whose input is "
    "the same tensor on every tp rank"
)


class ReplicateParallel(ParallelStyle):
    """Run a module (typically a norm on the replicated stream) on a replicated input, with its parameters as
    ``Replicate`` DTensors.

    Input: a DTensor is redistributed to ``Replicate`` if it is not already; a plain tensor is taken as the
    identical replica, and that is **checked** (``check``, :mod:`titanlike.parallel.replica_check`): on the first
    forward (``"first"``, the default) or every forward (``"always"``) a hash of the plain input and of the
    parameters' local tensors is compared across the mesh (one small all-reduce), and a difference is a one-line
    error naming the module and the style it needs (a norm over each rank's own heads: :class:`HeadNormParallel`);
    ``"never"`` trusts it. Output: the local tensor (``use_local_output=True``, the default), so that the next
    module's style places the f operator (identity forward, all-reduce backward); or the DTensor.
    Every replica computes the same parameter gradients: no communication of its own.
    """

    def __init__(self, *, use_local_output: bool = True, check: str = "first"):
        super().__init__()
        self.use_local_output = use_local_output
        ReplicaCheck(check, type(self).__name__, NORM_ADVICE)  # validates check
        self.check = check

    @staticmethod
    def _prepare_input_fn(replica_check, mod, inputs, device_mesh):
        x, *rest = inputs
        replicate = (Replicate(),) * device_mesh.ndim
        replica_check(mod, None if isinstance(x, DTensor) else x, device_mesh)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, replicate, run_check=False)
        elif tuple(x.placements) != replicate:
            x = x.redistribute(device_mesh, replicate)
        return (x, *rest)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replica_check = ReplicaCheck(self.check, type(self).__name__, NORM_ADVICE)
        module._titanlike_replica_check = replica_check
        return distribute_module(
            module,
            device_mesh,
            None,
            partial(self._prepare_input_fn, replica_check),
            partial(self._prepare_output_fn, self.use_local_output),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(use_local_output={self.use_local_output}, check={self.check!r})"


class StreamParallel(SequenceParallel):
    """``SequenceParallel`` for a module on the sequence-parallel residual stream (what the ``Norm`` entry translates
    to under SP): parameters ``Replicate`` over tp, input and output the stream's ``Shard(1)`` DTensor. A norm runs
    as DTensor ops, as torch's style runs it; an ``nn.Linear`` (DeepSeek-V3's MTP ``eh_proj``) runs as the local
    matmul of this rank's shard with its parameters' local tensors, their gradients ``Partial`` over tp (what the
    DTensor matmul gives them). Why: torch 2.11's DTensor refuses a Linear on a ``(batch, seq, dim)`` input sharded
    on seq ("Attempted to flatten multiple dimensions, with dimension 1 being sharded"; 2.13 flattens it).
    Same collectives as ``SequenceParallel``: none forward, the gradient all-reduce of the parameters."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if type(module) is nn.Linear:  # a subclass (torchao's Float8Linear) keeps its own forward
            module.forward = partial(_stream_linear, module, device_mesh)
        return module


def _stream_linear(module: nn.Linear, device_mesh: DeviceMesh, x: Tensor) -> Tensor:
    # the input hook made it the stream's Shard(1) DTensor; the output hook keeps the returned DTensor
    shard = (Shard(1),) * device_mesh.ndim
    local = x.redistribute(device_mesh, shard).to_local() if tuple(x.placements) != shard else x.to_local()

    def own(p):
        return None if p is None else p.to_local(grad_placements=[*p.placements[:-1], Partial()])

    y = F.linear(local, own(module.weight), own(module.bias))
    return DTensor.from_local(y, device_mesh, shard, run_check=False)


class HeadNormParallel(SequenceParallel):
    """A norm over each rank's own heads (Qwen3's per-head ``q_norm`` / ``k_norm``, run on ``q_proj(x).view(B, T,
    -1, head_dim)`` after a ``ColwiseParallel`` q_proj): its local input is this rank's shard of the heads dim
    ``heads_dim`` (2 for ``(batch, seq, heads, head_dim)``), its weight replicated; autograd gives the weight a
    ``Partial`` gradient (each rank saw its own heads), summed over tp by :func:`apply_tp`'s gradient hook. What the
    ``HeadNorm`` sharding entry translates to; never :class:`ReplicateParallel` (each rank sees other heads).
    Output: the local tensor (``use_local_output=True``), for the attention that follows."""

    def __init__(self, heads_dim: int = 2, *, use_local_output: bool = True):
        super().__init__(sequence_dim=heads_dim, use_local_output=use_local_output)
        self.heads_dim = heads_dim

    def __repr__(self) -> str:
        return f"{type(self).__name__}(heads_dim={self.heads_dim}, use_local_output={self.use_local_output})"


class LatentParallel(ParallelStyle):
    """A module inside a tensor-parallel region that runs on the replicated input before the heads split (MLA's
    latent down-projections and their norms; the ``Latent`` sharding entry): its parameters ``Replicate`` DTensors,
    its input kept (a DTensor from the region) or taken as the replicated local tensor, its output a ``Replicate``
    DTensor for the column-wise projection that follows. Each rank's heads use the whole output, so autograd gives
    its parameters (and its input) ``Partial`` gradients, summed over tp by :func:`apply_tp`'s gradient hook (and by
    the region's f operator). ``local_output``: the output as the local tensor with a ``Partial`` gradient (a
    tensor joined to per-head local ones: MLA's shared RoPE key). No forward communication."""

    def __init__(self, *, local_output: bool = False):
        super().__init__()
        self.local_output = local_output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(local_output={self.local_output})"

    @staticmethod
    def _input_fn(mod, inputs, device_mesh):
        x, *rest = inputs
        if not isinstance(x, DTensor):
            replicate, partial = (Replicate(),) * device_mesh.ndim, (Partial(),) * device_mesh.ndim
            x = from_local(x, device_mesh, replicate, partial)
        return (x, *rest)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = self.local_output

        def output_fn(mod, outputs, mesh):
            if local and isinstance(outputs, DTensor):
                return outputs.to_local(grad_placements=(Partial(),) * mesh.ndim)
            return outputs

        def replicate_params(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Replicate()] * mesh.ndim))
                mod.register_parameter(key, dist_param)

        return distribute_module(module, device_mesh, replicate_params, input_fn=self._input_fn, output_fn=output_fn)


class PositionEmbeddingParallel(ReplicateParallel):
    """A replicated position table whose (seq, dim) output takes the residual stream's layout: ``Replicate``, or
    under sequence parallelism ``Shard(0)`` (this rank's positions), so that adding it to the token embedding's
    ``Shard(1)`` output is local. ``use_local_output=True``: that layout's local tensor (for a plan whose residual
    stream is plain local tensors, like torchtitan's): the ``(seq / tp, dim)`` rows of this rank under SP."""

    def __init__(self, sequence_parallel: bool, *, use_local_output: bool = False, check: str = "first"):
        super().__init__(use_local_output=False, check=check)
        self.sequence_parallel = sequence_parallel
        self.local_output = use_local_output

    def _apply(self, module, device_mesh):
        sp, local = self.sequence_parallel, self.local_output

        def output_fn(mod, inputs, output):
            if sp and isinstance(output, DTensor):
                output = output.redistribute(device_mesh, [Shard(0)])
            return output.to_local() if local and isinstance(output, DTensor) else output

        module = super()._apply(module, device_mesh)
        module.register_forward_hook(output_fn)
        return module


class TokenLocalParallel(ParallelStyle):
    """A module that runs on this rank's own tokens of the sequence-parallel stream (``Shard(1)`` over tp): the
    input DTensor's local shard goes in (no all-gather; its gradient flows back as that shard), the output comes back
    as the same ``Shard(1)`` DTensor. No communication of its own. Its parameters stay plain tensors for a
    data-parallel reduction over tp (each tp rank saw other tokens): ``parallelize_model`` FSDP-shards an MoE block's
    router and shared experts over ``dp_shard x cp x tp`` (``ParallelDims.moe_token_mesh``) and splits its experts
    over ``ep``, which borrows the tp ranks. Applied alone, without that reduction, the parameters would train on
    this rank's tokens only."""

    @staticmethod
    def _prepare_input_fn(mod, inputs, device_mesh):
        x, *rest = inputs
        if not isinstance(x, DTensor) or tuple(x.placements) != (Shard(1),):
            got = f"DTensor{tuple(x.placements)}" if isinstance(x, DTensor) else "a plain tensor"
            raise ValueError(
                f"TokenLocalParallel ({type(mod).__name__}): needs the sequence-parallel stream, a DTensor "
                f"(Shard(1),) over tp, got {got}; enable sequence parallelism"
            )
        return (x.to_local(), *rest)

    @staticmethod
    def _prepare_output_fn(mod, outputs, device_mesh):
        return DTensor.from_local(outputs, device_mesh, (Shard(1),), run_check=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module._titanlike_token_local = True  # its parameters are data-parallel over tp (_check_all_or_nothing)
        # plain hooks, not distribute_module: that replicates every parameter and buffer left plain
        module.register_forward_pre_hook(lambda mod, inputs: self._prepare_input_fn(mod, inputs, device_mesh))
        module.register_forward_hook(lambda mod, inputs, out: self._prepare_output_fn(mod, out, device_mesh))
        return module


class HeadParamsParallel(ParallelStyle):
    """A module whose parameters are sharded with the heads (``Shard(0)``: attention sinks, a per-head decay, a
    depthwise conv's channels) inside a tensor-parallel region: its tensor inputs are this rank's local shards along
    ``heads_dim`` (taken as DTensors ``Shard(heads_dim)``, so the parameters broadcast against them shard by shard),
    its outputs local tensors (a module called with no input returns this rank's part of its parameters). What the
    ``HeadParams`` sharding entry translates to."""

    def __init__(self, heads_dim: int = 2):
        super().__init__()
        self.heads_dim = heads_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = self.heads_dim

        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

        def input_fn(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Shard(dim)], run_check=False) if isinstance(x, Tensor) else x
                for x in inputs
            )

        def output_fn(mod, outputs, mesh):
            if isinstance(outputs, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(heads_dim={self.heads_dim})"


def _head_params_style(entry: sh.HeadParams) -> ParallelStyle:
    return HeadParamsParallel(entry.heads_dim)


# ------------------------------------------------------------------------------------------------- the translator
def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    """SP: the norm runs on the local sequence shard, weight replicated (SequenceParallel). Without SP it runs
    on the replicated stream and hands a local tensor to the next module's f operator."""
    return StreamParallel() if sequence_parallel else ReplicateParallel()


def _head_norm_style(entry: sh.HeadNorm) -> ParallelStyle:
    """A norm over this rank's own heads: :class:`HeadNormParallel` on the entry's heads dim."""
    return HeadNormParallel(entry.heads_dim)


class _FusedInProportion(ParallelStyle):
    """:class:`FusedColwiseParallel` with the chunk sizes of a :class:`titanlike.sharding.FusedColwise` given in
    proportion, scaled to the Linear's output features when applied."""

    def __init__(self, entry: sh.FusedColwise):
        super().__init__()
        self.entry = entry

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sizes = self.entry.sizes(module.out_features)
        return FusedColwiseParallel(sizes, head_dim=self.entry.head_dim)._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(chunks in proportion {self.entry.chunks}, head_dim={self.entry.head_dim})"


def _fused_style(entry: sh.FusedColwise) -> ParallelStyle:
    if isinstance(entry.chunks, int):
        return FusedColwiseParallel(entry.chunks, head_dim=entry.head_dim)
    return _FusedInProportion(entry)


def _entries(sharding) -> Mapping[str, sh.Entry]:
    entries = getattr(sharding, "sharding", sharding)  # a ModelSpec, or the entries themselves
    if not isinstance(entries, Mapping) or not all(isinstance(e, sh.Entry) for e in entries.values()):
        raise TypeError(
            f"tp_plan needs titanlike.sharding entries ({{module pattern: Entry}}) or a ModelSpec, got "
            f"{type(sharding).__name__}"
        )
    return entries


def tp_plan(
    sharding, sequence_parallel: bool = False, loss_parallel: bool = True, *, float8: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan (``{module-path pattern: ParallelStyle}``, for ``parallelize_module`` /
    :func:`apply_tp`) of ``sharding``: ``titanlike.sharding`` entries by module pattern, or a ``ModelSpec`` (its
    ``sharding``). The one translator of entries into styles (table in the module docstring).

    ``float8=True`` (every float8-eligible Linear is a tensorwise torchao ``Float8Linear``): torchao's float8 styles
    for the entries with ``float8=True`` and for the regions holding them, so that the SP all-gather and the
    backward move float8 bytes.
    """
    entries = _entries(sharding)
    seq = Shard(1) if sequence_parallel else Replicate()
    f8_patterns = sh.float8_patterns(entries) if float8 else ()
    if f8_patterns:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

    def styles(pattern: str, entry: sh.Entry) -> ParallelStyle:
        f8 = pattern in f8_patterns
        colwise = Float8ColwiseParallel if f8 else ColwiseParallel
        rowwise = Float8RowwiseParallel if f8 else RowwiseParallel
        if isinstance(entry, sh.VocabEmbedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False)
        if isinstance(entry, sh.PositionTable):
            return PositionEmbeddingParallel(sequence_parallel)
        if isinstance(entry, sh.Norm):
            return _norm_style(sequence_parallel)
        if isinstance(entry, sh.HeadNorm):
            return _head_norm_style(entry)
        if isinstance(entry, sh.HeadParams):
            return _head_params_style(entry)
        if isinstance(entry, sh.Latent):
            return LatentParallel(local_output=entry.local_output)
        if isinstance(entry, sh.Region):
            inner = any(p.startswith(pattern + ".") for p in f8_patterns)
            prepare = PrepareFloat8ModuleInput if inner else PrepareModuleInput
            if entry.keyword:
                return prepare(
                    input_kwarg_layouts={entry.keyword: seq}, desired_input_kwarg_layouts={entry.keyword: Replicate()}
                )
            return prepare(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                input_kwarg_layouts={},
                desired_input_kwarg_layouts={},
            )
        if isinstance(entry, sh.Colwise):
            return colwise()
        if isinstance(entry, sh.FusedColwise):
            return _fused_style(entry)
        if isinstance(entry, sh.Rowwise):
            return rowwise(output_layouts=seq, use_local_output=False)
        if isinstance(entry, sh.TokenLocal):
            if not sequence_parallel:
                raise ValueError(
                    f"tp_plan: '{pattern}' runs on each rank's own tokens (TokenLocal), which needs sequence "
                    f"parallelism; enable it"
                )
            return TokenLocalParallel()
        if isinstance(entry, sh.Head):
            return ColwiseParallel(
                input_layouts=seq,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        raise TypeError(f"tp_plan: no tensor-parallel style for sharding entry {entry!r} ('{pattern}')")

    return {pattern: styles(pattern, entry) for pattern, entry in entries.items()}


def _matches(model: nn.Module, pattern: str) -> bool:
    return any(sh.matches(pattern, name) for name, _ in model.named_modules())


def _layout(p) -> str:
    return f"DTensor{tuple(p.placements)} on {p.device_mesh}" if isinstance(p, DTensor) else "a plain tensor"


def _same_layout(first_name: str, first, name: str, p) -> None:
    """Tied parameters re-tied after the plan must have been sharded alike (each module's style distributed its own
    copy); otherwise the one parameter could not serve both modules."""
    same = isinstance(p, DTensor) == isinstance(first, DTensor) and (
        not isinstance(p, DTensor) or (p.placements == first.placements and p.device_mesh == first.device_mesh)
    )
    if not same:
        raise ValueError(
            f"tied parameters '{first_name}' and '{name}' got different tensor-parallel layouts "
            f"({_layout(first)} vs {_layout(p)}); give both modules styles that shard the "
            f"shared weight alike (RowwiseParallel embedding + ColwiseParallel head: Shard(0))"
        )


def _grad_to_param_placements(param: nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _reduce_partial_grads(model: nn.Module) -> None:
    """Give every DTensor parameter's gradient the parameter's placements as soon as it is accumulated."""
    for p in model.parameters():
        if isinstance(p, DTensor) and not getattr(p, "_titanlike_grad_hook", False):
            p.register_post_accumulate_grad_hook(_grad_to_param_placements)
            p._titanlike_grad_hook = True


def _check_all_or_nothing(model: nn.Module) -> None:
    """After the plan: either no parameter is a DTensor (nothing to do for tp) or all are. A parameter left a plain
    tensor next to DTensors fails later, far away (``aten.add.Tensor got mixed torch.Tensor and DTensor``, or a
    foreach optimizer refusing the mix), naming no module: refuse it here, naming the modules."""
    local = [n + "." for n, m in model.named_modules() if getattr(m, "_titanlike_token_local", False)]
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) and not n.startswith(tuple(local))]
    if plain and len(plain) != len(list(model.parameters())):
        owners = sorted({n.rpartition(".")[0] or "<root>" for n in plain})
        shown = ", ".join(owners[:6]) + (f" and {len(owners) - 6} more" if len(owners) > 6 else "")
        raise ValueError(
            f"apply_tp: the plan leaves the parameters of {shown} plain tensors next to DTensors; give "
            f"those modules a style (norms: ReplicateParallel() on the replicated stream, SequenceParallel() on a "
            f"sequence shard, HeadNormParallel(heads_dim=...) over each rank's own heads)"
        )


HEAD_COUNT_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads", "n_heads", "n_kv_heads", "n_head")


def _head_counts(model: nn.Module):
    """(where, count) of every head count ``model``'s modules expose: their own integer attributes
    (:data:`HEAD_COUNT_ATTRS`), and a ``transformers`` ``config`` (``num_attention_heads`` / ``num_key_value_heads``),
    named after the outermost module holding it."""
    configs: set[int] = set()
    for name, module in model.named_modules():
        where = name or type(model).__name__
        for attr in HEAD_COUNT_ATTRS:
            v = vars(module).get(attr)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                yield f"{where}.{attr}", v
        config = vars(module).get("config")
        if config is not None and id(config) not in configs:
            configs.add(id(config))
            for attr in ("num_attention_heads", "num_key_value_heads"):
                v = getattr(config, attr, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    yield f"{where}.config.{attr}", v


def _check_head_counts(model: nn.Module, tp: int) -> None:
    """tp must divide every head count a module exposes (each rank holds whole heads); one line naming them."""
    bad = [f"{where} = {v}" for where, v in _head_counts(model) if v % tp]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(
            f"apply_tp: tp {tp} does not divide the head counts of {type(model).__name__} ({shown}); each tp rank "
            f"must hold whole heads: choose a tp that divides the query and key/value head counts"
        )


def _named_targets(model: nn.Module, plan) -> list[tuple[str, ParallelStyle]]:
    """(module name, style) of every module a plan applies to."""
    if not isinstance(plan, Mapping):
        return [("", plan)]
    return [
        (name, style)
        for pattern, style in plan.items()
        for name, _ in model.named_modules()
        if sh.matches(pattern, name)
    ]


def _positional_layouts_match(name: str, n: int, module: nn.Module, args, kwargs) -> None:
    if len(args) != n:
        given = ", ".join(kwargs) or "none"
        raise ValueError(
            f"PrepareModuleInput on '{name or '<root>'}' ({type(module).__name__}) has {n} positional "
            f"input_layouts, but the module is called with {len(args)} positional argument(s) (keyword "
            f"arguments: {given}); give keyword arguments their layouts by name: "
            f"PrepareModuleInput(input_kwarg_layouts={{'<name>': ...}}, "
            f"desired_input_kwarg_layouts={{'<name>': Replicate()}})"
        )


def _refuse_keyword_calls(model: nn.Module, plan) -> None:
    """A ``PrepareModuleInput`` with positional ``input_layouts`` on a module called with keyword arguments
    (``transformers`` calls ``self_attn(hidden_states=...)``) fails in torch with "module inputs and input_layouts
    should have same length!", naming no module: a pre-hook run before torch's names the module and the fix."""
    for name, style in _named_targets(model, plan):
        layouts = getattr(style, "input_layouts", None) if isinstance(style, PrepareModuleInput) else None
        if layouts is None:
            continue

        hook = partial(_positional_layouts_match, name, len(layouts))
        module = model.get_submodule(name)
        module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, ParallelStyle] | ParallelStyle | None = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    float8: bool = False,
) -> nn.Module:
    """Apply a tensor-parallel plan to ``model`` over the 1-D ``tp_mesh``, in place; return ``model``.

    ``plan=None``: a registered model's own plan, :func:`tp_plan` of its spec's sharding entries with
    ``sequence_parallel``, ``loss_parallel`` and ``float8``, skipping keys ``model`` lacks (a pipeline stage
    without embedding or head). A user plan (``{pattern: style}`` or one style for the whole
    module) is applied as given; a key matching no module is an error. Works on the meta device. Tied
    parameters stay tied, and gradients keep their parameter's placements.

    Refused in one line: a tp that does not divide a head count some module exposes (``num_heads``,
    ``num_key_value_heads``, ``n_heads``, ``n_kv_heads``, a ``transformers`` ``config``); at the first forward, a
    positional ``PrepareModuleInput`` on a module called with keyword arguments (use ``input_kwarg_layouts=``), and
    a :class:`ReplicateParallel` input or parameter that is not the same on every tp rank.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D {tp_mesh}; pass mesh['tp']")
    if plan is None:
        from titanlike.models import spec_for

        spec = spec_for(model)
        if spec is None:
            raise ValueError(
                f"apply_tp: {type(model).__name__} is not a registered model, so there is no default "
                f"plan; pass plan={{module-path pattern: ParallelStyle}} for it"
            )
        plan = tp_plan(spec.sharding_of(getattr(model, "args", None)), sequence_parallel, loss_parallel, float8=float8)
        # each key for the modules it matches (an MoE model's dense feed-forward is not in every block: torch warns
        # on a pattern some blocks lack), in the plan's order
        names = [name for name, _ in model.named_modules()]
        plan = {name: style for k, style in plan.items() for name in names if sh.matches(k, name)}
    elif isinstance(plan, dict):
        missing = [k for k in plan if not _matches(model, k)]
        if missing:
            raise ValueError(
                f"tensor-parallel plan keys {missing} match no submodule of {type(model).__name__}; "
                f"use module paths like those of model.named_modules() ('*' matches one atom)"
            )
    _check_head_counts(model, tp_mesh.size())
    tied = tie_groups(model)
    parallelize_module(model, tp_mesh, plan)
    _refuse_keyword_calls(model, plan)
    name_checks(model)
    retie(model, tied, check=_same_layout)
    _check_all_or_nothing(model)
    _reduce_partial_grads(model)
    return model
