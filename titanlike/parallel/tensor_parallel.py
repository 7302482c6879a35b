"""Tensor (+ sequence) parallelism, Megatron-style, applied from outside with DTensor ``ParallelStyle`` s.

The plan is data: :func:`tp_plan` returns ``{module-path pattern: ParallelStyle}`` for the Llama model, and
:func:`apply_tp` applies any such plan (a user's plan for their own module too) with ``parallelize_module``.

The Llama plan (``seq`` = ``Shard(1)`` under sequence parallelism, else ``Replicate()``):

=============================  =======================================================================
``tok_embeddings``             RowwiseParallel: vocab-sharded table, output ``seq`` (all-reduce, or
                               reduce-scatter under SP)
``layers.*.attention_norm``    SP: SequenceParallel (runs on the local sequence shard, weight replicated);
``layers.*.ffn_norm``, norm    else ReplicateParallel (runs on the replicated stream, returns a local tensor)
``layers.*.attention``         PrepareModuleInput ``seq`` -> Replicate: the "f" operator, identity forward /
``layers.*.feed_forward``      all-reduce backward (SP: all-gather forward / reduce-scatter backward)
``wq wk wv w1 w3``             ColwiseParallel: output-feature shards, local heads / hidden units
``wo w2``                      RowwiseParallel, output ``seq``: the "g" operator, all-reduce forward (SP:
                               reduce-scatter)
``output``                     ColwiseParallel from ``seq``: logits stay a DTensor ``Shard(-1)`` for the
                               vocab-parallel loss, or are all-gathered (``loss_parallel=False``)
=============================  =======================================================================

One transformer block therefore costs two all-reduces forward and two backward (SP: an all-gather and a
reduce-scatter in each direction instead of each all-reduce, same bytes, plus the all-reduce of the two norm
weight gradients, each rank having seen a different part of the sequence). The embedding and the two
RowwiseParallel projections return DTensors (``use_local_output=False``), so the residual stream between
blocks is a DTensor: per-block ``torch.compile`` needs that, and SP needs it to know the stream is sharded.

Every parameter of the parallelized model is a DTensor (norm weights ``Replicate``): one foreach optimizer
step handles them all (it refuses a mix of DTensors and plain tensors), and checkpoints see one kind.

Tied embeddings: RowwiseParallel on the embedding and ColwiseParallel on the head both shard the shared
(vocab, dim) weight as ``Shard(0)``; :func:`apply_tp` re-ties them so the model keeps ONE parameter.
Rotary tables are root buffers, untouched. Gradients of replicated DTensor parameters (SP norm weights)
come out of autograd as ``Partial`` sums; a hook reduces them right away so every gradient has its
parameter's placements (clipping, optimizer and checkpoints see ordinary gradients).
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["tp_plan", "model_tp_plan", "apply_tp", "ReplicateParallel", "shared_parameters"]


class ReplicateParallel(ParallelStyle):
    """Run a module (typically a norm) on a replicated input, with its parameters as ``Replicate`` DTensors.

    Input: a DTensor is redistributed to ``Replicate`` if it is not already; a plain tensor is taken as the
    (identical) replica. Output: the local tensor (``use_local_output=True``, the default), so that the next
    module's style places the f operator (identity forward, all-reduce backward); or the DTensor.
    Every replica computes the same parameter gradients: no communication of its own.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    @staticmethod
    def _prepare_input_fn(mod, inputs, device_mesh):
        x, *rest = inputs
        replicate = (Replicate(),) * device_mesh.ndim
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, replicate, run_check=False)
        elif tuple(x.placements) != replicate:
            x = x.redistribute(device_mesh, replicate)
        return (x, *rest)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, None, self._prepare_input_fn, partial(self._prepare_output_fn, self.use_local_output)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(use_local_output={self.use_local_output})"


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    """SP: the norm runs on the local sequence shard, weight replicated (SequenceParallel). Without SP it runs
    on the replicated stream and hands a local tensor to the next module's f operator."""
    return SequenceParallel() if sequence_parallel else ReplicateParallel()


def tp_plan(
    sequence_parallel: bool = False, loss_parallel: bool = True, float8: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of ``titanlike.models.llama.Transformer`` (see the module docstring).

    Keys are ``parallelize_module`` patterns (``*`` matches one path atom). The plan covers a whole model;
    :func:`apply_tp` skips the keys a pipeline stage does not have. ``float8=True`` (every block projection is a
    tensorwise torchao ``Float8Linear``): torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` /
    ``PrepareFloat8ModuleInput`` in the blocks, as torchtitan does: the activation is cast to float8 before the
    all-gather (SP) and the output gradient in the backward, so those collectives move float8 bytes.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "layers.*.attention_norm": _norm_style(sequence_parallel),
        "layers.*.attention": prepare(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": colwise(),
        "layers.*.attention.wk": colwise(),
        "layers.*.attention.wv": colwise(),
        "layers.*.attention.wo": rowwise(output_layouts=seq, use_local_output=False),
        "layers.*.ffn_norm": _norm_style(sequence_parallel),
        "layers.*.feed_forward": prepare(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": colwise(),
        "layers.*.feed_forward.w3": colwise(),
        "layers.*.feed_forward.w2": rowwise(output_layouts=seq, use_local_output=False),
        "norm": _norm_style(sequence_parallel),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def _matches(model: nn.Module, pattern: str) -> bool:
    atoms = pattern.split(".")
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(atoms) and all(fnmatch(p, a) for p, a in zip(parts, atoms)):
            return True
    return False


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Names of each parameter reachable under more than one name (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _layout(p) -> str:
    return f"DTensor{tuple(p.placements)} on {p.device_mesh}" if isinstance(p, DTensor) else "a plain tensor"


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make tied parameters one parameter again (each module's style distributed its own copy)."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            p = model.get_parameter(name)
            if p is first:
                continue
            same = isinstance(p, DTensor) == isinstance(first, DTensor) and (
                not isinstance(p, DTensor) or (p.placements == first.placements and p.device_mesh == first.device_mesh)
            )
            if not same:
                raise ValueError(
                    f"tied parameters '{names[0]}' and '{name}' got different tensor-parallel layouts "
                    f"({_layout(first)} vs {_layout(p)}); give both modules styles that shard the "
                    f"shared weight alike (RowwiseParallel embedding + ColwiseParallel head: Shard(0))"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


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
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain and len(plain) != len(list(model.parameters())):
        owners = sorted({n.rpartition(".")[0] or "<root>" for n in plain})
        shown = ", ".join(owners[:6]) + (f" and {len(owners) - 6} more" if len(owners) > 6 else "")
        raise ValueError(
            f"apply_tp: the plan leaves the parameters of {shown} plain tensors next to DTensors; give "
            f"those modules a style (ReplicateParallel() for modules that run replicated, e.g. norms)"
        )


def model_tp_plan(
    spec, args, sequence_parallel: bool = False, loss_parallel: bool = True, *, float8: bool = False
) -> dict:
    """The TP plan of a registered model: its spec's ``tp_plan``, or for the built-in models (whose specs leave it
    None) the plan kept here in the parallel package: Llama's :func:`tp_plan`, GPT-2's
    :func:`titanlike.parallel.gpt2.tp_plan`."""
    if spec.tp_plan is not None:
        return spec.tp_plan(args, sequence_parallel, loss_parallel, float8=float8)
    if spec.name == "llama3":
        return tp_plan(sequence_parallel, loss_parallel, float8)
    if spec.name == "gpt2":
        from titanlike.parallel import gpt2

        if float8:
            raise ValueError("float8 training is wired for the Llama model only; turn float8.recipe off for gpt2")
        return gpt2.tp_plan(args, sequence_parallel, loss_parallel)
    raise ValueError(f"model '{spec.name}' registered no tp_plan; give its ModelSpec one (docs/adding_a_model.md)")


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

    ``plan=None`` uses :func:`tp_plan` ``(sequence_parallel, loss_parallel)`` and skips keys ``model`` lacks
    (a pipeline stage without embedding or head). A user plan (``{pattern: style}`` or one style for the whole
    module) is applied as given; a key matching no module is an error. Works on the meta device. Tied
    parameters stay tied, and gradients keep their parameter's placements.
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
        plan = model_tp_plan(spec, getattr(model, "args", None), sequence_parallel, loss_parallel, float8=float8)
        plan = {k: v for k, v in plan.items() if _matches(model, k)}
    elif isinstance(plan, dict):
        missing = [k for k in plan if not _matches(model, k)]
        if missing:
            raise ValueError(
                f"tensor-parallel plan keys {missing} match no submodule of {type(model).__name__}; "
                f"use module paths like those of model.named_modules() ('*' matches one atom)"
            )
    tied = shared_parameters(model)
    parallelize_module(model, tp_mesh, plan)
    _retie(model, tied)
    _check_all_or_nothing(model)
    _reduce_partial_grads(model)
    return model
