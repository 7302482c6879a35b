"""Layout-invariant training (``training.layout_invariant``): every layout bitwise equal to one process.

The debug-shaped Llama (tiny: dim 64, 2 layers, GQA), 5 AdamW steps with clipping acting every step, float32 and
bfloat16 (autocast over float32 master weights), V = 8 virtual ranks of M = 2 canonical microbatches of one sequence:
one process against FSDP 2, pp 2 1F1B, pp 2 LoopedBFS (each stage's backwards in reverse microbatch order) and pp 2
InterleavedZeroBubble (split backward) on 2 ranks, FSDP 4, HSDP 2x2 and pp 2 ZBVZeroBubble x FSDP 2 on 4 ranks: every
loss, every gradient norm and every weight after every step equal bit for bit (max |diff| exactly 0). Planted
mutations must each break it: a rank's micro-batches accumulated linearly (also per stage parameter, and FSDP's
unsharded leaves under pp x FSDP), the ranks' partial sums in another order (a ring reduce-scatter's rotation), a
stage's leaves in a rotated microbatch order, FSDP's own reduce-scatter left on under pp x FSDP, the clipping norm
summed per FSDP shard. The default reduction (layout_invariant off) is run beside
for the record.

    python tests/parallel/shared_launch.py --world-size 2 --run invariant=out.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlike.config import load_config, model_args_from_config
from titanlike.layout import schedule_facts
from titanlike.loss import IGNORE_INDEX
from titanlike.models import get_spec
from titanlike.parallel import ParallelDims, build_parallel_model, loss_group
from titanlike.parallel.invariant import CanonicalTree, InOrder, tree_sum
from titanlike.training.optim import build_optimizer
from titanlike.training.step import train_step

STEPS = 5
SEQ = 16
VOCAB = 128
V = 8  # virtual ranks (the default training.virtual_dp_degree)
M = 2  # canonical microbatches per virtual rank
L = 1  # local_batch_size: the canonical microbatch
GLOBAL = V * M * L
BASE = (
    "--model.flavor",
    "tiny",
    "--model.dim",
    "64",
    "--model.max_seq_len",
    str(SEQ),
    "--training.seq_len",
    str(SEQ),
    "--training.max_norm",
    "0.05",
    "--training.global_batch_size",
    str(GLOBAL),
    "--training.local_batch_size",
    str(L),
    "--optimizer.lr",
    "0.01",
)
# name -> (world size, data-parallel replicate, shard, pipeline degree, pipeline schedule)
LAYOUTS = {
    "fsdp2": (2, 1, 2, 1, None),
    "pp2_1f1b": (2, 1, 1, 2, "1F1B"),
    "fsdp4": (4, 1, 4, 1, None),
    "hsdp2x2": (4, 2, 2, 1, None),
    "pp2_loopedbfs": (2, 1, 1, 2, "LoopedBFS"),  # each stage's backwards in reverse microbatch order
    "pp2_izb": (2, 1, 1, 2, "InterleavedZeroBubble"),  # split backward: the weight gradients by autograd.grad
    "pp2_zbv_fsdp2": (4, 1, 2, 2, "ZBVZeroBubble"),  # pp x FSDP, the V schedule with split backward
}
# the schedules whose stages run their backwards out of microbatch order: leaves that wait for their turn (LoopedBFS
# runs each schedule step's in reverse: all but one of its pipeline microbatches)
WAITING = {"LoopedBFS": 7}
PP_LOCAL_BATCH = 8  # under pp: micro-batches of 8 sequences, each 8 pipeline microbatches of one (the canonical)
DTYPES = ("float32", "bfloat16")


class _Linear:
    """Mutation: a rank's micro-batches accumulated one after the other (what autograd's += does)."""

    def __init__(self):
        self.value, self.held, self.pushed = None, 1, 0

    def push(self, leaf):
        from titanlike.parallel.invariant import _add

        self.value = leaf if self.value is None else _add(self.value, leaf)
        self.pushed += 1

    def result(self):
        return self.value


class _Rotated:
    """Mutation: a stage's pipeline-microbatch leaves summed in a rotated order (the last microbatch's first: what
    pushing in arrival order gives under a schedule that runs one weight-gradient pass late). Pushing LoopedBFS's
    leaves in its arrival order (each schedule step's in reverse) is no mutation: a balanced tree over a reversed
    power-of-two block is its mirror image, and each addition is commutative: the same bits."""

    def __init__(self, reduction):
        self.reduction, self.ordered = reduction, InOrder(reduction.local_tree())

    def push(self, index, leaf):
        self.ordered.push((index + 1) % self.reduction.leaves, leaf)

    def result(self):
        return self.ordered.result()

    @property
    def pushed(self):
        return self.ordered.pushed

    @property
    def held(self):
        return self.ordered.held


def _fsdp_reduces(reduction):
    """Mutation: FSDP's own reduce-scatter left on under pp x FSDP: the stages' backward passes no longer hand their
    gradients to the tree (autograd accumulates FSDP's unsharded gradients over the pipeline microbatches, FSDP
    reduce-scatters them at the schedule's end)."""
    for stage in reduction.stages:
        for method in ("backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad"):
            vars(stage).pop(method, None)  # the reduction's wrappers off: torch's own methods
    reduction.finish_gradients = lambda: setattr(reduction, "_trees", None)


def _rotate(reduction):
    """Mutation: the ranks' partial sums in ring order from this rank (a ring reduce-scatter's rotation)."""
    me = dist.get_rank(reduction.dp_group) if reduction.dp_group is not None else 0

    def order(received):
        k = me % len(received)
        return received[k:] + received[:k]

    return order


def _per_shard(reduction):
    """Mutation: the clipping norm summed per FSDP shard (one block per shard, the layout's own boundaries)."""

    def blocks(rows):
        shards = reduction.dp  # FSDP's shard degree (dp under FSDP; the HSDP layouts are not mutated)
        size = -(-rows // shards)
        return sorted({min(k * size, rows) for k in range(shards + 1)})

    return blocks


MUTATIONS = {
    "linear_microbatches": ("fsdp2", lambda red: setattr(red, "local_tree", _Linear)),
    "linear_pipeline_microbatches": ("pp2_1f1b", lambda red: setattr(red, "local_tree", _Linear)),
    "rank_order_changed": ("fsdp4", lambda red: setattr(red, "cross_order", _rotate(red))),
    "stage_leaves_rotated": ("pp2_loopedbfs", lambda red: setattr(red, "stage_tree", lambda: _Rotated(red))),
    "linear_stage_microbatches_fsdp": ("pp2_zbv_fsdp2", lambda red: setattr(red, "local_tree", _Linear)),
    "fsdp_reduce_scatter_on": ("pp2_zbv_fsdp2", _fsdp_reduces),
    "norm_per_shard": ("fsdp2", lambda red: setattr(red, "norm_blocks", _per_shard(red))),
}


def config(dtype: str, world, replicate, shard, pp=1, schedule=None, invariant: bool = True):
    args = [*BASE, "--training.dtype", dtype]
    if pp > 1:
        args += [
            "--parallelism.pipeline_parallel_degree",
            str(pp),
            "--parallelism.pipeline_parallel_schedule",
            schedule,
        ]
        args += ["--training.local_batch_size", str(PP_LOCAL_BATCH // replicate // shard)]
        if not schedule_facts(schedule).single_stage:  # 4 stages of 2 layers: the embedding and the head one each
            args += ["--parallelism.pipeline_parallel_first_stage_less_layers", "1"]
            args += ["--parallelism.pipeline_parallel_last_stage_less_layers", "1"]
    args += ["--parallelism.data_parallel_replicate_degree", str(replicate)]
    args += ["--parallelism.data_parallel_shard_degree", str(shard)]
    if invariant:
        args += ["--training.layout_invariant", "true"]
    return load_config(args, world_size=world)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: a different number of ignored labels per row."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(GLOBAL):
        labels[row, : (3 * row + step) % 7] = IGNORE_INDEX
    return inputs, labels


def micro_batches(step: int, dp_rank: int, dp: int, local: int = L) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel rank ``dp_rank``'s micro-batches of the step, as the loader cuts them: its contiguous slice of
    the global batch (virtual ranks dp_rank V/dp ..), in micro-batches of ``local`` sequences."""
    inputs, labels = batch(step)
    rows = GLOBAL // dp
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    return list(zip(inputs[mine].split(local), labels[mine].split(local)))


def build(cfg, dims):
    model_args = model_args_from_config(cfg, vocab_size=VOCAB)
    with torch.device("meta"):
        model = get_spec(cfg.model.name).build(model_args)
    return build_parallel_model(model, cfg, dims, torch.device("cpu"), init_seed=0)


def train(cfg, dims, dp_rank: int, dp: int, mutate=None):
    """Train STEPS steps; per step (loss, grad norm, {name: parameter}) copies, and the most partial gradient sums
    held at once."""
    built = build(cfg, dims)
    if mutate is not None:
        mutate(built.reduction)
    opt = build_optimizer(built.model_parts, cfg)
    dp_group = loss_group(dims) if dims.built else None
    out, held = [], 0
    for step in range(1, STEPS + 1):
        res = train_step(
            built.model_parts,
            opt,
            micro_batches(step, dp_rank, dp, cfg.training.local_batch_size),
            built.loss,
            max_norm=cfg.training.max_norm,
            clip_fn=built.clip_fn,
            dp_group=dp_group,
            pp_schedule=built.pp_schedule,
            pp_group=built.pp_group,
            has_last_stage=built.has_last_stage,
            forward_ctx=built.forward_context,
            reduction=built.reduction,
        )
        if built.reduction is not None:
            held = max(held, built.reduction.max_held)
        weights = {n: p.detach().clone() for part in built.model_parts for n, p in part.named_parameters()}
        out.append((res.loss, res.grad_norm, weights))
    return out, held


def _local(t, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(t, DTensor):
        return t.to_local(), distribute_tensor(ref, t.device_mesh, t.placements, src_data_rank=None).to_local()
    return t, ref


def compare(run, ref) -> dict[str, float]:
    """max |diff| of the losses, the gradient norms and every weight over the steps (this rank's shards)."""
    d = {"loss": 0.0, "grad_norm": 0.0, "weights": 0.0, "steps": 0}
    for (loss, norm, w), (rloss, rnorm, rw) in zip(run, ref):
        d["loss"] = max(d["loss"], abs(loss - rloss) if math.isfinite(loss) else math.inf)
        d["grad_norm"] = max(d["grad_norm"], abs(norm - rnorm) if math.isfinite(norm) else math.inf)
        for name, t in w.items():
            a, b = _local(t, rw[name])
            if a.numel():
                d["weights"] = max(d["weights"], (a.double() - b.double()).abs().max().item())
        d["steps"] += 1
    return d


def reduce_max(d: dict[str, float]) -> dict[str, float]:
    values = torch.tensor([v if v == v else math.inf for v in d.values()], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(d, values.tolist()))


def tree_facts() -> dict:
    """The canonical tree itself on plain numbers: a rank's subtree sums (dp 1, 2, 4, 8 of V = 8 virtual ranks of
    M = 3 microbatches) summed across the ranks give the one-process total bit for bit; a linear sum does not."""
    leaves = [
        torch.tensor(x, dtype=torch.float32)
        for x in torch.randn(V * 3, generator=torch.Generator().manual_seed(5)).mul(1e3).tolist()
    ]
    totals = {}
    for dp in (1, 2, 4, 8):
        per = V * 3 // dp
        subtrees = []
        for d in range(dp):
            tree = CanonicalTree(3, add=lambda a, b: a + b)
            for x in leaves[d * per : (d + 1) * per]:
                tree.push(x)
            subtrees.append(tree.result())
        totals[dp] = tree_sum(subtrees, add=lambda a, b: a + b).item()
    linear = leaves[0]
    for x in leaves[1:]:
        linear = linear + x
    return {"totals": totals, "linear": linear.item()}


def rank_main(rank: int, world_size: int, out: str) -> None:
    torch.use_deterministic_algorithms(True)
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    results: dict = {"world_size": world_size, "layouts": {}, "mutations": {}, "default": {}}
    meshes: dict = {}

    def dims_for(cfg):
        dims = ParallelDims.from_config(cfg, world_size)
        if dims.shape not in meshes:
            dims.build_mesh("cpu")
            meshes[dims.shape] = dims
        return meshes[dims.shape]

    refs = {}
    for dtype in DTYPES:
        t0 = time.perf_counter()
        refs[dtype], _ = train(config(dtype, 1, 1, 1), one, 0, 1)
        results.setdefault("reference_seconds", {})[dtype] = round(time.perf_counter() - t0, 2)
    for name, (world, *layout) in LAYOUTS.items():
        if world != world_size:
            continue
        for dtype in DTYPES:
            t0 = time.perf_counter()
            cfg = config(dtype, world, *layout)
            dims = dims_for(cfg)
            dp_rank, dp = (dims.get_mesh("dp").get_local_rank(), dims.dp) if dims.dp_enabled else (0, 1)
            run, held = train(cfg, dims, dp_rank, dp)
            r = reduce_max(compare(run, refs[dtype]))
            r["held"], r["seconds"] = held, round(time.perf_counter() - t0, 2)
            r["ref_grad_norms"] = [n for _, n, _ in refs[dtype]]
            results["layouts"][f"{name} {dtype}"] = r
            if rank == 0:
                print(f"[invariant ws={world_size}] {name} {dtype}: {r}", flush=True)
            # the default reduction on the same layout, for the record (float32): within rounding, not bitwise
            if dtype == "float32":
                cfg = config(dtype, world, *layout, invariant=False)
                base_ref = refs.setdefault("default", train(config(dtype, 1, 1, 1, invariant=False), one, 0, 1)[0])
                run, _ = train(cfg, dims_for(cfg), dp_rank, dp)
                results["default"][name] = reduce_max(compare(run, base_ref))
    for mname, (layout, mutate) in MUTATIONS.items():
        world, *parallel = LAYOUTS[layout]
        if world != world_size:
            continue
        cfg = config("float32", world, *parallel)
        dims = dims_for(cfg)
        dp_rank, dp = (dims.get_mesh("dp").get_local_rank(), dims.dp) if dims.dp_enabled else (0, 1)
        run, _ = train(cfg, dims, dp_rank, dp, mutate=mutate)
        results["mutations"][mname] = reduce_max(compare(run, refs["float32"]))
        if rank == 0:
            print(f"[invariant ws={world_size}] MUT {mname} on {layout}: {results['mutations'][mname]}", flush=True)
    results["tree"] = tree_facts()
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dist_utils import spawn

    sys.exit(spawn(rank_main, int(sys.argv[1]), sys.argv[2], timeout_s=120))
