"""Expert parallelism trains exactly like one device (float64, <= 1e-10): one launch per world size, every case.

Run once per world size (``python tests/parallel/moe_ep_worker.py --world-size 2 --out ep2.json``; the test
``test_expert_parallel.py`` does it for 2 and 4). For each :class:`Case` every rank builds the same seeded model, a
small stack of MoE layers between a token embedding and a dense head (:class:`MoEStack`), trains one copy as one
device on the full global batches and one copy under the case's layout on its slice of them, with the real
``train_step`` (the global-token loss contract: ``sum(CE) / global tokens``), 3 AdamW steps, the expert-bias
update from the global loads after every step and the sequence-wise aux loss on where the case says. After every
step it compares the loss, the gradient norm, every gradient and every weight (``full_tensor()``), the expert biases
and the aux-loss value (its contributions summed over the ranks). The layout's copy is built the trainer's way: on
the meta device, expert-parallel (``apply_ep``), experts FSDP-sharded over the ranks holding the same experts
(``apply_expert_fsdp``, the ``dp_shard_mod_ep`` mesh), everything else FSDP over all data ranks (``apply_fsdp``), then
each rank allocates and initialises only its shards; its start must equal the single-device init exactly.

Layouts: the root mesh is ``(dp_mod_ep, ep)`` (ep innermost); the data ranks are all ranks. ``split = "batch"``: each
rank holds whole sequences; ``"sequence"``: each rank holds a contiguous piece of every sequence (what context
parallelism does to the tokens; the stack has no attention, so pieces are independent but for the aux loss, whose
per-sequence counts are then summed over the ranks: ``set_aux_sequence_group``).

Mutations (:data:`MUTATIONS`) plant one bug for one case; the test asserts the comparison then fails.
Also written: ``comms`` (CommDebugMode counts and bytes of one MoE layer's forward and backward under ep) and
``splits`` (the all-to-all split sizes seen, to show they are uneven and sometimes 0).

    python tests/parallel/moe_ep_worker.py --world-size 2 --out OUT.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from gate import main as gate_main
from gate import patched
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from tp_probe_worker import BytesCommDebugMode

import titanlike.models.moe as moe_lib
import titanlike.parallel.expert_parallel as epm
from titanlike.init import init_parameters, normal, plan_from_patterns, trunc_normal
from titanlike.loss import IGNORE_INDEX, ScaledLoss, cross_entropy_loss
from titanlike.models.moe import (
    MoE,
    MoEArgs,
    aux_losses,
    init_moe_buffers,
    moe_modules,
    param_init_patterns,
    reset_moe_stats,
    set_aux_loss_denominator,
    set_expert_dispatch,
)
from titanlike.parallel import apply_fsdp, clip_grad_norm_, plain_clip_grad_norm_
from titanlike.parallel.expert_parallel import (
    ExpertParallel,
    apply_ep,
    apply_expert_fsdp,
    set_aux_sequence_group,
    sync_expert_biases,
)
from titanlike.training.step import train_step

TOL = 1e-10
STEPS = 3
BATCH, SEQ, VOCAB, DIM, LAYERS = 8, 16, 64, 16, 2
SEED = 1234
MAX_NORM = 0.2  # the gradient norm is ~0.5: clipping acts every step


class MoELayer(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.moe = MoE(args)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class MoEStack(nn.Module):
    """Token embedding, ``LAYERS`` residual MoE layers, a dense head: (batch, seq) ids -> (batch, seq, vocab)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, args.dim)
        self.layers = nn.ModuleDict({str(i): MoELayer(args) for i in range(LAYERS)})
        self.output = nn.Linear(args.dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h)


def init_plan(args: MoEArgs):
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": normal(1.0),
            r"output\.weight": trunc_normal(args.dim**-0.5),
            **param_init_patterns(r"layers\.(\d+)\.moe\."),
            **(
                {r"layers\.\d+\.moe\.(router\.gate\.bias|experts\.b[123])": normal(0.1)}
                if args.expert_bias_terms
                else {}
            ),
        }
    )


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    ep: int
    args: MoEArgs
    split: str = "batch"  # batch | sequence
    bias_init: tuple[float, ...] | None = None  # a skewed starting bias (all tokens to some ranks' experts)
    mutation: str | None = None
    dispatch: str = "uneven"  # the layout's expert dispatch (the single-device reference always runs "uneven")


DEEPSEEK = MoEArgs(  # sigmoid + bias balancing + shared expert + group-limited routing, renormalised and scaled
    dim=DIM,
    hidden_dim=32,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    score_func="sigmoid",
    route_norm=True,
    route_scale=2.5,
    num_groups=4,
    topk_groups=2,
    load_balance_coeff=0.05,
    aux_loss_coeff=0.01,
)
QWEN = MoEArgs(  # softmax top-k renormalised, the sequence-wise aux loss, and the bias on too
    dim=DIM, hidden_dim=32, num_experts=8, top_k=2, route_norm=True, load_balance_coeff=0.05, aux_loss_coeff=0.01
)
SKEWED = DEEPSEEK.replace(num_groups=1, topk_groups=1, num_shared_experts=0)
GPT_OSS = QWEN.replace(expert_bias_terms=True, activation="clamped_swiglu", router_bias=True, swiglu_limit=0.05)
TO_0_AND_1 = (1.0, 1.0) + (0.0,) * 6  # every token picks experts 0 and 1: their padded buffers exactly full

CASES = [
    Case("ep2 deepseek routing", 2, 2, DEEPSEEK),
    Case("ep2 qwen routing, sequences split over ranks", 2, 2, QWEN, split="sequence"),
    Case("ep2 every token to rank 0's experts", 2, 2, SKEWED, bias_init=(1.0,) * 4 + (0.0,) * 4),
    Case("MUT ep2 combine ignores the routing weights", 2, 2, DEEPSEEK, mutation="combine_unweighted"),
    Case("MUT ep2 bias update from local loads", 2, 2, DEEPSEEK, mutation="local_loads"),
    Case("MUT ep2 aux loss normalised per rank", 2, 2, DEEPSEEK, mutation="aux_per_rank"),
    Case("MUT ep2 stale split sizes", 2, 2, DEEPSEEK, mutation="stale_splits"),
    Case("ep2 padded deepseek routing", 2, 2, DEEPSEEK, dispatch="padded"),
    Case("ep2 padded qwen routing (sequences split)", 2, 2, QWEN, split="sequence", dispatch="padded"),
    Case("ep2 padded gpt-oss experts (biases and clamp)", 2, 2, GPT_OSS, dispatch="padded"),
    Case("ep2 padded every token to experts 0 and 1", 2, 2, SKEWED, bias_init=TO_0_AND_1, dispatch="padded"),
    Case("MUT ep2 padded capacity one row short", 2, 2, SKEWED, "batch", TO_0_AND_1, "capacity_short", "padded"),
    Case("MUT ep2 padded blocks not regrouped", 2, 2, DEEPSEEK, mutation="padded_no_regroup", dispatch="padded"),
    Case("ep4 deepseek routing", 4, 4, DEEPSEEK),
    Case("ep4 padded deepseek routing", 4, 4, DEEPSEEK, dispatch="padded"),
    Case("ep2 x expert fsdp2 (dp4)", 4, 2, DEEPSEEK),
    Case("ep2 x expert fsdp2, 6 experts (fsdp on dim 1)", 4, 2, QWEN.replace(num_experts=6)),
    Case("MUT ep2 x expert fsdp2 averaging", 4, 2, DEEPSEEK, mutation="expert_fsdp_average"),
    Case("ep2 padded x expert fsdp2 (6 experts)", 4, 2, QWEN.replace(num_experts=6), dispatch="padded"),
]


# ------------------------------------------------------------------------------------------------ mutations
def _stale_splits():
    """The counts exchange runs once per module and is reused (as if the routing never changed)."""
    original = ExpertParallel._exchange_counts

    def cached(self, counts, mesh):
        if not hasattr(self, "_stale"):
            self._stale = original(self, counts, mesh)
        return self._stale

    return patched(ExpertParallel, "_exchange_counts", cached)


def _capacity_short():
    """The padded buffers one row short of the worst case (an expert that gets every token loses one)."""
    return patched(moe_lib, "padded_capacity", lambda tokens, experts, dtype: tokens - 1)


MUTATIONS = {
    "stale_splits": _stale_splits,
    "capacity_short": _capacity_short,
    "padded_no_regroup": lambda: patched(epm, "_swap_blocks", lambda x, outer, inner: x),
    "local_loads": lambda: patched(epm, "_all_reduce_loads", lambda loads, group: loads),
}


@contextlib.contextmanager
def recording_splits(out: list[int]):
    """Every dispatch split size (rows this rank sends to each ep rank) goes to ``out``."""
    original = ExpertParallel._exchange_counts

    def recording(self, counts, mesh):
        out.extend(counts.view(mesh.size(), -1).sum(1).tolist())
        return original(self, counts, mesh)

    with patched(ExpertParallel, "_exchange_counts", recording):
        yield


def unweighted_combine(routed, weights, order):
    """The combine that drops the routing weights (planted on the layout's blocks only)."""
    return MoE.combine(routed, torch.ones_like(weights), order)


# ------------------------------------------------------------------------------------------------ data, models
def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(BATCH):  # an uneven number of ignored labels per row and per sequence piece
        labels[row, : (3 * row + step) % 11] = IGNORE_INDEX
    return inputs, labels


def build(case: Case, device: str = "cpu") -> MoEStack:
    torch.manual_seed(0)
    with torch.device(device):
        model = MoEStack(case.args).to(torch.float64)
    if device != "meta":
        init_parameters(model, init_plan(case.args), SEED)
        init_moe_buffers(model)
        _skew(model, case)
    return model


def _skew(model, case):
    if case.bias_init is not None:
        for m in moe_modules(model):
            m.expert_bias.copy_(torch.tensor(case.bias_init))


def sum_ce(logits, labels):
    return cross_entropy_loss(logits, labels, reduction="sum")


_MESHES: dict = {}


def meshes(world: int, ep: int):
    """(ep mesh, expert-FSDP mesh, data mesh) from one root ``(dp_mod_ep, ep)`` mesh, built once per shape."""
    if (world, ep) not in _MESHES:
        root = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
        _MESHES[(world, ep)] = (root["ep"], root["dp_mod_ep"], root[("dp_mod_ep", "ep")]._flatten("dp"))
    return _MESHES[(world, ep)]


def parallel_model(case: Case):
    ep_mesh, efsdp_mesh, dp_mesh = meshes(case.world, case.ep)
    model = build(case, "meta")
    set_expert_dispatch(model, case.dispatch)
    apply_ep(model, ep_mesh)
    apply_expert_fsdp(model, efsdp_mesh)
    apply_fsdp(model, dp_mesh, blocks=list(model.layers.values()) + [model.output])
    model.to_empty(device="cpu")
    init_parameters(model, init_plan(case.args), SEED)
    init_moe_buffers(model, torch.device("cpu"))
    _skew(model, case)
    if case.mutation == "combine_unweighted":
        for m in moe_modules(model):
            m.combine = unweighted_combine
    if case.mutation == "expert_fsdp_average":  # FSDP's default for the expert group: the mean over its ranks
        for _, m in epm.experts_modules(model):
            m.set_gradient_divide_factor(float(efsdp_mesh.size()))
    group = dp_mesh.get_group()
    if case.split == "sequence":
        set_aux_sequence_group(model, group)
    return model, group


def micro_batch(case: Case, inputs, labels, rank: int):
    if case.split == "batch":
        rows = BATCH // case.world
        cut = (slice(rank * rows, (rank + 1) * rows), slice(None))
    else:
        cols = SEQ // case.world
        cut = (slice(None), slice(rank * cols, (rank + 1) * cols))
    return [(inputs[cut], labels[cut])]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a, b) -> float:
    if a.shape != b.shape:
        return math.inf
    return (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max().item()


def biases(model) -> torch.Tensor:
    return torch.stack([m.expert_bias for m in moe_modules(model) if m.expert_bias is not None] or [torch.zeros(1)])


def one_step(model, optimizer, micro, group, clip_fn, aux_sequences, step_loss):
    """One train_step, then the bias update from the loads (summed over ``group``). Returns (result, aux value)."""
    set_aux_loss_denominator(model, aux_sequences)
    res = train_step([model], optimizer, micro, step_loss, max_norm=MAX_NORM, clip_fn=clip_fn, dp_group=group)
    aux = aux_losses(model).sum().reshape(1)
    if group is not None:
        dist.all_reduce(aux, group=group)
    sync_expert_biases(model, group)
    reset_moe_stats(model)
    return res, aux.item()


def train_and_compare(case, rank, ref, model, group, aux_sequences, diffs) -> None:
    """The 3 steps side by side (AdamW, clipping), the max differences into ``diffs``."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    for step in range(1, STEPS + 1):
        inputs, labels = global_batch(step)
        r_res, r_aux = one_step(ref, ref_opt, [(inputs, labels)], None, plain_clip_grad_norm_, BATCH, _loss())
        micro = micro_batch(case, inputs, labels, rank)
        res, aux = one_step(model, optimizer, micro, group, clip_grad_norm_, aux_sequences, _loss())
        diffs["loss"] = max(diffs["loss"], abs(res.loss - r_res.loss))
        diffs["grad_norm"] = max(diffs["grad_norm"], abs(res.grad_norm - r_res.grad_norm))
        diffs["aux"] = max(diffs["aux"], abs(aux - r_aux))
        for p, q in zip(model.parameters(), ref.parameters()):
            g = math.inf if p.grad is None else _diff(_full(p.grad), q.grad)
            diffs["grads"] = max(diffs["grads"], g)
            diffs["weights"] = max(diffs["weights"], _diff(_full(p), q))
            if step == 1:
                diffs["grads_step1"] = max(diffs["grads_step1"], g)
        diffs["biases"] = max(diffs["biases"], _diff(biases(model), biases(ref)))
        if step == 1:
            diffs["loss_step1"] = diffs["loss"]
            diffs["ref_grad_norm"], diffs["ref_aux"] = r_res.grad_norm, r_aux
        diffs["steps_done"] = step


def run_case(case: Case, rank: int) -> dict:
    t0 = time.perf_counter()
    names = ("init", "loss", "loss_step1", "grad_norm", "grads", "grads_step1", "weights", "biases", "aux")
    diffs = dict.fromkeys(names, 0.0)
    ref = build(case)
    mutation = MUTATIONS[case.mutation]() if case.mutation in MUTATIONS else contextlib.nullcontext()
    error, splits = "", []
    with mutation, recording_splits(splits):
        model, group = parallel_model(case)
        for p, q in zip(model.parameters(), ref.parameters()):
            diffs["init"] = max(diffs["init"], _diff(_full(p), q))
        local_sequences = BATCH // case.world if case.split == "batch" else BATCH
        aux_sequences = local_sequences if case.mutation == "aux_per_rank" else BATCH
        try:
            train_and_compare(case, rank, ref, model, group, aux_sequences, diffs)
        except RuntimeError as e:  # stale splits: the dispatch refuses, on every rank at the same all-to-all
            error = str(e).strip().splitlines()[-1]
            kept = ("loss_step1", "grads_step1") if diffs.get("steps_done", 0) >= 1 else ()
            diffs.update({k: math.inf for k in names[1:] if k not in kept})
    reference = {k: diffs.pop(k, None) for k in ("ref_grad_norm", "ref_aux", "steps_done")}
    values = torch.tensor([v if v == v else math.inf for v in diffs.values()], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    diffs = dict(zip(diffs, values.tolist()))
    return {
        **diffs,
        **reference,
        "mutation": case.mutation,
        "dispatch": case.dispatch,
        "error": error,
        "ok": diffs["init"] == 0.0 and all(v <= TOL for k, v in diffs.items() if k != "init"),
        "bias_range": float(biases(ref).max() - biases(ref).min()),
        "min_split": min(splits, default=-1),
        "max_split": max(splits, default=-1),
        "expert_placements": [str(p) for p in model.layers["0"].moe.experts.w1.placements],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _loss() -> ScaledLoss:
    return ScaledLoss(sum_ce)


# ------------------------------------------------------------------------------------------------ probes
def probe_comms(rank: int, world: int) -> dict:
    """One MoE layer under ep (no FSDP): the collectives of its forward and of its backward, and the split sizes."""
    case = Case("probe", world, world, DEEPSEEK.replace(aux_loss_coeff=0.0))
    model = build(case)
    layer = model.layers["0"].moe
    apply_ep(layer, meshes(world, world)[0])
    tokens = (BATCH // world) * SEQ
    x = torch.randn(BATCH // world, SEQ, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_()
    seen = []
    original = ExpertParallel._exchange_counts

    def recording(self, counts, mesh):
        received = original(self, counts, mesh)
        seen.append((counts.view(mesh.size(), -1).sum(1).tolist(), received.sum(1).tolist()))
        return received

    with patched(ExpertParallel, "_exchange_counts", recording):
        with BytesCommDebugMode() as fwd:
            y = layer(x)
    with BytesCommDebugMode() as bwd:
        y.sum().backward()
    send, recv = seen[0]
    return {
        "forward": fwd.summary(),
        "backward": bwd.summary(),
        "counts": {str(k): v for k, v in fwd.get_comm_counts().items()},
        "send": send,
        "recv": recv,
        "tokens": tokens,
        "experts_grad_is_shard": isinstance(layer.experts.w1.grad, DTensor),
    }


class HostReads(TorchDispatchMode):
    """Records every host read of device data and every op whose output shape depends on data: the scalar reads
    (``aten._local_scalar_dense``: ``item``, ``int(t)``, ``tolist``'s elements), ``nonzero`` and any op tagged
    ``dynamic_output_shape`` / ``data_dependent_output``, plus every ``Tensor.tolist`` / ``Tensor.item`` call."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def recording(t, *a, _name=name, _original=original, **k):
                self.seen.append(f"Tensor.{_name}")
                return _original(t, *a, **k)

            self._patches.enter_context(patched(torch.Tensor, name, recording))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = set(getattr(func, "tags", ()))
        data_dependent = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & tags
        if data_dependent or func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def moe_forward_backward(layer: nn.Module, rank: int, rows: int) -> None:
    x = torch.randn(rows, SEQ, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    layer(x.requires_grad_()).sum().backward()


def probe_padded(rank: int, world: int) -> dict:
    """One MoE layer under ep with the padded dispatch: its host reads (none) and collectives, forward and backward,
    and the same for the uneven dispatch (whose host reads show that the recorder records)."""
    out = {}
    for dispatch in ("padded", "uneven"):
        layer = build(Case("probe", world, world, DEEPSEEK.replace(aux_loss_coeff=0.0))).layers["0"].moe
        set_expert_dispatch(layer, dispatch)
        apply_ep(layer, meshes(world, world)[0])
        moe_forward_backward(layer, rank, BATCH // world)  # warm: lazy initialisations off the record
        with HostReads() as reads, BytesCommDebugMode() as comms:
            moe_forward_backward(layer, rank, BATCH // world)
        out[dispatch] = {"host_reads": sorted(set(reads.seen)), "comms": comms.summary()}
    return out


def probe_refusals(world: int) -> dict:
    ep_mesh = meshes(world, world)[0]
    out = {}
    for name, fn in {
        "indivisible": lambda: (
            apply_ep(build(Case("x", world, world, QWEN.replace(num_experts=6))), ep_mesh)
            if world == 4
            else apply_ep(build(Case("x", world, world, QWEN.replace(num_experts=3, top_k=1))), ep_mesh)
        ),
        "no experts": lambda: apply_ep(nn.Linear(2, 2), ep_mesh),
        "twice": lambda: apply_ep(apply_ep(build(Case("x", world, world, QWEN)), ep_mesh), ep_mesh),
    }.items():
        try:
            fn()
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


def worker(rank: int, world: int, out: str, only: list[str] | None) -> None:
    # full_tensor() of the 2-D expert weights warns that it gathers one mesh dim at a time: expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    probes = {} if only else {"comms": probe_comms(rank, world), "refusals": probe_refusals(world)}
    if not only:
        probes["padded"] = probe_padded(rank, world)
    results = {}
    for case in CASES:
        if case.world != world or (only and case.name not in only):
            continue
        results[case.name] = run_case(case, rank)
        if rank == 0:
            r = results[case.name]
            print(
                f"[ep ws={world}] {case.name:50s} ok={r['ok']!s:5} init {r['init']:.0e} loss {r['loss']:.1e} "
                f"grad_norm {r['grad_norm']:.1e} grads {r['grads']:.1e} weights {r['weights']:.1e} "
                f"biases {r['biases']:.1e} aux {r['aux']:.1e} ({r['seconds']} s)",
                flush=True,
            )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, probes.get("comms"))
    if rank == 0:
        probes["comms_per_rank"] = gathered
        Path(out).write_text(json.dumps({"world": world, "tol": TOL, "cases": results, "probes": probes}, indent=1))


if __name__ == "__main__":
    sys.exit(gate_main(entry=worker))
