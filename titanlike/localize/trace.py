"""Hooks that record (one device) or compare (a layout) every point of a training step.

The points, in execution order: every module's forward output (each tensor of it), every module's gradient with
respect to each tensor input (positional or keyword) in backward, every parameter's gradient after the
data-parallel reductions (before clipping), every parameter after the optimizer step.

The hooks see what the module's caller sees: the inputs before a parallel style's input hook converts them, the
outputs after its output hook did (a forward pre-hook prepended, a forward hook appended); a second pair of hooks
notes the layout inside (a DTensor's placements before ``to_local``). Input gradients come from an identity
autograd function wrapped around each input tensor. Collectives are counted by a dispatch mode with
``CommDebugMode``'s sets of collective ops (CommDebugMode itself registers module-tracker hooks that
``torch.distributed.pipelining``'s backward refuses). A forward during backward (activation checkpointing's
recomputation) is not a new point. Everything is installed by :class:`Tracer` and removed by ``close``: training
without the localiser runs none of it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titanlike.localize.cuts import PENDING, Cut, DataCut, cut_for, describe_placement, max_diff

__all__ = ["PHASES", "Point", "Reference", "Tracer", "CollectiveCounter", "clean_fqn"]

PHASES = ("forward", "backward", "gradient", "update")
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module|module)(?=\.|$)")
KEEP = 6  # divergent points per rank whose tensors are kept for the evidence


def clean_fqn(name: str) -> str:
    """A module's name in the plain model (wrappers of activation checkpointing, compile, DDP removed)."""
    return _WRAPPERS.sub("", name).lstrip(".") or "(model)"


def _collective_ops() -> set:
    from torch.distributed.tensor.debug import _comm_mode as cm

    ops = set(cm.c10d_collective_ops) | set(getattr(cm, "funcol_native", ())) | set(getattr(cm, "funcol_py", ()))
    return ops


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective dispatched (the ops CommDebugMode counts), by op name, in ``counts``."""

    def __init__(self):
        super().__init__()
        self.ops = _collective_ops()
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars into collectives, counted then
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet in self.ops:
            name = str(packet).split(".")[-1].rstrip("_").replace("allreduce", "all_reduce")
            name = name.replace("allgather", "all_gather").replace("_into_tensor", "").replace("_coalesced", "")
            self.counts[name.replace("_base", "").replace("_single", "").lstrip("_")] += 1
        return out

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


@dataclass
class Point:
    """One compared point where the layout and one device differ by more than the tolerance."""

    step: int
    phase: str
    fqn: str
    what: str  # "output 0", "input hidden_states", "weight", ...
    micro: int
    order: int  # its index in the one-device run's execution order of this phase (parameter order for the last two)
    rank: int
    diff: float
    placement: str  # of the compared tensor as the caller sees it
    inner: str = ""  # the layout inside the module (a DTensor's placements before to_local)
    comms: dict[str, int] = field(default_factory=dict)
    note: str = ""
    hint: str = ""  # what the rank saw of the cause (a raise: the module's weight and input)

    def key(self) -> tuple:
        return (self.step, PHASES.index(self.phase), self.micro, self.order, self.what)


@dataclass
class StepRecord:
    """One device's step: every point's tensors, in execution order."""

    forward: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)  # (fqn, occ) -> output tensors
    inputs: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)  # (fqn, occ) -> float input tensors
    backward: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (fqn, occ, input key) -> grad
    forward_order: dict[tuple, int] = field(default_factory=dict)
    backward_order: dict[tuple, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # fqn -> calls per step
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norm: float = 0.0


class Reference:
    """The one-device run's records, one :class:`StepRecord` per step."""

    def __init__(self):
        self.steps: list[StepRecord] = []
        self.param_order: dict[str, int] = {}


class _Tap(torch.autograd.Function):
    """Identity; its backward hands the gradient with respect to the wrapped input to ``on_grad``."""

    @staticmethod
    def forward(ctx, on_grad, x):
        ctx.on_grad = on_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_grad(grad)
        return None, grad


def _float_tensors(out) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Tracer:
    """Hooks on every module of ``parts``: record into ``reference`` (``compare=False``) or compare with it."""

    def __init__(
        self,
        parts: list[nn.Module],
        reference: Reference,
        *,
        compare: bool,
        data: DataCut | None = None,
        rank: int = 0,
        tol: float = 1e-10,
        root: bool = True,
    ):
        """``root=False``: no hooks on each part's root (pipeline stages: a stage's root is not the model's)."""
        self.parts, self.ref, self.compare, self.data, self.rank, self.tol = parts, reference, compare, data, rank, tol
        self.counter = CollectiveCounter()
        self.points: list[Point] = []
        self.kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # point key -> (local, expected)
        self.compared = 0
        self.not_compared: set[tuple[str, str]] = set()
        self.stack: list[str] = []  # modules whose forward is running (innermost last)
        self.running: dict[str, tuple] = {}  # fqn -> (module, its float inputs) while its forward runs
        self.step = 0
        self.paused = False  # set while the pipeline stages infer their shapes on placeholder tensors
        self.handles = []
        self._calls: dict[str, int] = defaultdict(int)
        for part in parts:
            for name, module in part.named_modules():
                if name or root:
                    self._install(clean_fqn(name), module)

    # ----------------------------------------------------------------------------------- lifecycle
    def pause_during(self, owner, name: str) -> None:
        """No points while ``owner.name`` runs (the pipeline stages' metadata inference on placeholder tensors)."""
        original = getattr(owner, name)

        def paused(*args, **kwargs):
            self.paused = True
            try:
                return original(*args, **kwargs)
            finally:
                self.paused = False

        setattr(owner, name, paused)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def begin_step(self, step: int) -> None:
        self.step = step
        self._calls.clear()
        if not self.compare:
            self.ref.steps.append(StepRecord())

    @property
    def record(self) -> StepRecord:
        return self.ref.steps[self.step - 1]

    # ----------------------------------------------------------------------------------- hooks
    def _install(self, fqn: str, module: nn.Module) -> None:
        state: dict = {}

        def pre(mod, args, kwargs):
            # not a point: a recomputation in backward (activation checkpointing), a no-grad forward (the pipeline
            # stages' shape inference)
            if _in_backward() or not torch.is_grad_enabled() or self.paused:
                state["skip"] = True
                return None
            state["skip"] = False
            j = self._calls[fqn]
            self._calls[fqn] += 1
            state["j"] = j
            state["comms"] = self.counter.snapshot()
            state["weight"] = None
            self.stack.append(fqn)
            self.running[fqn] = (mod, [a for a in (*args, *kwargs.values()) if _is_float(a)])
            if not self.compare:
                self.record.inputs[(fqn, j)] = [t.detach().clone() for t in _to_local_full(self.running[fqn][1])]
            else:
                state["model_cut"] = self._model_cuts(fqn, j, args, kwargs)
            args = tuple(self._tap(fqn, j, str(i), a, state) for i, a in enumerate(args))
            kwargs = {k: self._tap(fqn, j, k, v, state) for k, v in kwargs.items()}
            return args, kwargs

        def inner_pre(mod, args, kwargs):
            if not state.get("skip"):
                state["inner_in"] = [describe_placement(a) for a in (*args, *kwargs.values()) if _is_float(a)]

        def inner_post(mod, args, kwargs, out):
            if not state.get("skip"):
                state["weight"] = getattr(mod, "weight", None)
                state["inner_out"] = [describe_placement(t) for t in _float_tensors(out)]

        def post(mod, args, kwargs, out):
            if state.get("skip"):
                return None
            if self.stack and self.stack[-1] == fqn:
                self.stack.pop()
            _, inputs = self.running.pop(fqn, (None, []))
            self._forward_point(fqn, state, out, inputs)
            return None

        self.handles += [
            module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
            module.register_forward_pre_hook(inner_pre, with_kwargs=True),
            module.register_forward_hook(inner_post, with_kwargs=True, prepend=True),
            module.register_forward_hook(post, with_kwargs=True),
        ]

    def _model_cuts(self, fqn: str, j: int, args: tuple, kwargs: dict) -> dict[str, bool]:
        """Input key -> whether this call's input is cut along a model-parallel dim (a rank's heads, say)."""
        keyed = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        floats = [(k, a) for k, a in keyed if _is_float(a)]
        refs = self.record.inputs.get((fqn, self._occ(fqn, j)[1]), [])
        micro = self._occ(fqn, j)[0]
        out = {}
        for (k, a), r in zip(floats, refs):
            cut = cut_for(a, r, self.data, micro)
            out[k] = isinstance(cut, Cut) and cut.model_parallel()
        return out

    def _tap(self, fqn: str, j: int, key: str, a, state: dict):
        if not (_is_float(a) and a.requires_grad and torch.is_grad_enabled()):
            return a
        shape_of = a  # the layout the gradient comes back in

        def on_grad(grad):
            if self.paused:
                return
            self._backward_point(fqn, j, key, grad, shape_of, state)

        return _Tap.apply(on_grad, a)

    # ----------------------------------------------------------------------------------- points
    def _occ(self, fqn: str, j: int) -> tuple[int, int]:
        """(micro-batch, occurrence within it) of this rank's j-th call of ``fqn`` in the step."""
        per = self.record.calls.get(fqn, 1) or 1
        return j // per, j % per

    def _call_of(self, fqn: str, occ: int) -> str:
        """Which of a module's calls in a micro-batch (the output head of the next-token and of each MTP depth)."""
        n = self.record.calls.get(fqn, 1)
        return f", call {occ + 1} of {n}" if n > 1 else ""

    def _forward_point(self, fqn: str, state: dict, out, inputs: list[torch.Tensor]) -> None:
        j = state["j"]
        tensors = _float_tensors(out)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda g, s=state: s.__setitem__("bwd_comms", self.counter.snapshot()) or None)
        if not self.compare:
            rec = self.record
            rec.forward[(fqn, j)] = [t.detach().clone() for t in _to_local_full(tensors)]
            rec.forward_order.setdefault((fqn, j), len(rec.forward_order))
            rec.calls[fqn] = j + 1
            return
        micro, occ = self._occ(fqn, j)
        refs = self.record.forward.get((fqn, occ))
        if refs is None:
            return
        comms = _since(state["comms"], self.counter.snapshot())
        before = len(self.points)
        for i, (t, r) in enumerate(zip(tensors, refs)):
            inner = state.get("inner_out", [])
            self._compare(
                "forward",
                fqn,
                f"output {i}{self._call_of(fqn, occ)}",
                micro,
                self.record.forward_order[(fqn, occ)],
                t,
                r,
                state.get("weight"),
                comms,
                inner[i] if i < len(inner) else "",
            )
        if len(self.points) > before == 0:  # this rank's first divergent point: did it arise before this module?
            note = self._inputs_differ(fqn, occ, micro, inputs, state.get("weight"))
            for p in self.points[before:]:
                p.note = note

    def _inputs_differ(self, fqn: str, occ: int, micro: int, inputs: list, weight) -> str:
        """Where a module's output differs: whether its inputs already did (the divergence then arose before it, in
        the enclosing module's own code between its submodules), in words; "" when its inputs agree."""
        refs = self.record.inputs.get((fqn, occ), [])
        for i, (t, r) in enumerate(zip(inputs, refs)):
            cut = cut_for(t, r, self.data, micro, weight)
            if cut == PENDING or cut is None:
                continue
            d = max_diff(t, cut.apply(r))
            if d > self.tol:
                parent = self.stack[-1] if self.stack else "the model"
                return (
                    f"{fqn}'s input {i} already differs (max |diff| {d:.1e}): the divergence arose before it, in "
                    f"{parent}'s forward code around its submodules"
                )
        return ""

    def _backward_point(self, fqn: str, j: int, key: str, grad, like, state: dict) -> None:
        if not self.compare:
            rec = self.record
            k = (fqn, j, key)
            rec.backward[k] = _to_local_full([grad])[0].detach().clone()
            rec.backward_order.setdefault(k, len(rec.backward_order))
            return
        micro, occ = self._occ(fqn, j)
        ref = self.record.backward.get((fqn, occ, key))
        if ref is None:
            return
        cuts = state.get("model_cut", {})
        if any(cuts.values()) and not cuts.get(key, True):
            # an input whole on every model-parallel rank, used with another cut along that dim (MLA's shared RoPE
            # key beside this rank's heads): its gradient here is this rank's partial sum, reduced further up
            self.not_compared.add((fqn, "backward"))
            return
        comms = _since(state.get("bwd_comms", {}), self.counter.snapshot())
        order = self.record.backward_order[(fqn, occ, key)]
        inner = ", ".join(sorted(set(state.get("inner_in", []))))
        what = f"input {key}{self._call_of(fqn, occ)}"
        self._compare("backward", fqn, what, micro, order, grad, ref, state.get("weight"), comms, inner)

    def _compare(self, phase, fqn, what, micro, order, t, ref, weight, comms, inner="") -> None:
        cut = cut_for(t, ref, self.data, micro, weight)
        if cut == PENDING or cut is None:
            if cut is None:
                self.not_compared.add((fqn, phase))
            return
        if phase == "backward" and cut.whole_on_data_ranks(self.data, micro):
            # the gradient of an input every data-parallel / context-parallel rank holds whole (a sink passed as an
            # input, a gathered latent): this rank's partial sum, reduced with the parameters' gradients
            self.not_compared.add((fqn, phase))
            return
        expected = cut.apply(ref)
        d = max_diff(t, expected)
        self.compared += 1
        if d > self.tol:
            p = Point(self.step, phase, fqn, what, micro, order, self.rank, d, describe_placement(t), inner, comms)
            self.points.append(p)
            if len(self.kept) < KEEP:
                local = t.to_local() if hasattr(t, "to_local") else t
                self.kept[p.key()] = (local.detach().to(torch.float64).clone(), expected.to(torch.float64).clone())

    # ----------------------------------------------------------------------------------- parameters
    def parameters_point(self, phase: str, scale: float = 1.0) -> None:
        """Every parameter's gradient (``phase="gradient"``, times ``scale``) or value (``"update"``): record or
        compare."""
        from torch.distributed.tensor import DTensor

        rec = self.record
        for part in self.parts:
            for name, p in part.named_parameters(remove_duplicate=False):
                t = p.grad if phase == "gradient" else p
                if t is not None and scale != 1.0:
                    t = t.detach() * scale
                if not self.compare:
                    store = rec.grads if phase == "gradient" else rec.weights
                    if t is not None:
                        store[name] = t.detach().clone()
                    self.ref.param_order.setdefault(name, len(self.ref.param_order))
                    continue
                ref = (rec.grads if phase == "gradient" else rec.weights).get(name)
                if ref is None:
                    continue
                order = self.ref.param_order.get(name, 0)
                fqn, _, leaf = name.rpartition(".")
                if t is None:
                    self._point(phase, fqn, leaf, order, float("inf"), "none", "", "no gradient")
                    continue
                if isinstance(t, DTensor) and isinstance(p, DTensor) and t.placements != p.placements:
                    note = (
                        f"the gradient's placement ({describe_placement(t)}) is not the parameter's "
                        f"({describe_placement(p)}): a reduction owed to it was never made"
                    )
                    self._point(
                        phase, fqn, leaf, order, float("inf"), describe_placement(t), describe_placement(p), note
                    )
                    continue
                self._compare_param(phase, fqn, leaf, order, t, ref)

    def norm_point(self, norm: float) -> None:
        """The step's global gradient norm (before clipping): recorded, or compared after every parameter's."""
        if not self.compare:
            self.record.grad_norm = norm
            return
        d = abs(norm - self.record.grad_norm)
        self.compared += 1
        if not d <= self.tol:
            self._point("gradient", "(gradient norm)", "norm", 1 << 30, d, "", "", "")

    def _compare_param(self, phase, fqn, leaf, order, t, ref) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            from torch.distributed.tensor import distribute_tensor

            expected = distribute_tensor(ref.detach(), t.device_mesh, t.placements, src_data_rank=None).to_local()
        else:
            expected = ref
        d = max_diff(t, expected)
        self.compared += 1
        if d > self.tol:
            p = self._point(phase, fqn, leaf, order, d, describe_placement(t), "", "")
            if len(self.kept) < KEEP:
                local = t.to_local() if isinstance(t, DTensor) else t
                self.kept[p.key()] = (local.detach().to(torch.float64).clone(), expected.to(torch.float64).clone())

    def _point(self, phase, fqn, what, order, diff, placement, inner, note) -> Point:
        p = Point(self.step, phase, fqn or "(model)", what, 0, order, self.rank, diff, placement, inner, {}, note)
        self.points.append(p)
        return p

    def failed(self, exc: BaseException) -> None:
        """The layout raised during the step: a point at the innermost module running (forward) or the step."""
        fqn = self.stack[-1] if self.stack else "(step)"
        phase = "forward" if self.stack else "backward"
        order = self.record.forward_order.get((fqn, 0), 0) if self.stack else 0
        msg = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        mod, inputs = self.running.get(fqn, (None, []))
        weight = getattr(mod, "weight", None)
        placement = ", ".join(f"{describe_placement(a)} {list(a.shape)}" for a in inputs)
        inner = f"weight {describe_placement(weight)} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else ""
        point = Point(self.step, phase, fqn, "raised", 0, order, self.rank, float("inf"), placement, inner, {}, msg)
        point.hint = _raise_hint(weight, inputs)
        self.points.append(point)


def _raise_hint(weight, inputs: list[torch.Tensor]) -> str:
    """A column-wise (``Shard(0)``) weight given a local input that holds 1/k of its in-features (this rank's heads
    or hidden units): the module was planned column-wise where its input called for row-wise."""
    from torch.distributed.tensor import DTensor, Shard

    if not (isinstance(weight, DTensor) and weight.dim() == 2 and inputs) or isinstance(inputs[0], DTensor):
        return ""
    for p, k in zip(weight.placements, weight.device_mesh.shape):
        if isinstance(p, Shard) and p.dim == 0 and k > 1 and inputs[0].shape[-1] * k == weight.shape[1]:
            return (
                f"its input holds 1/{k} of its {weight.shape[1]} in-features (this rank's share, e.g. its heads), "
                f"but its weight is split column-wise (Shard(0)), which needs the whole input: plan it row-wise "
                f"(RowwiseParallel), the partner of a column-wise module before it"
            )
    return ""


def _is_float(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _to_local_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One device's tensors as plain tensors (a reference built with DTensors, e.g. on a 1-rank mesh, gathered)."""
    from torch.distributed.tensor import DTensor

    return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
