"""The trainer's way in: any train.py flags, the configured model and layout against the same model on one device.

The configuration is read as train.py reads it (``load_config``, the tokenizer's vocabulary, ``layout_violations``)
with ``training.dtype`` float64; a bad one is one line and exit 2 before any rank starts. On every rank the one-device
model is built and seeded (``init_weights(seed=training.seed)``) and trained with ``train_step`` on the whole global
batch; the layout is built as the trainer builds it (on the meta device, ``build_parallel_model`` with the sharded
init from the same seed, pipeline stages included) and trained with ``train_step`` on this rank's micro-batches (its
data-parallel rows, its context-parallel chunks in the load-balanced order, gradient accumulation, pipeline
microbatches). Batches: seeded random tokens of the tokenizer's vocabulary (the same on every rank), a different
number of ignored labels per row; with ``model.attn_mask_type = "block_causal"`` the tokenizer's end-of-text token is
planted twice per row, so documents cross the micro-batch and sequence cuts.

Gradients are compared after the data-parallel reductions and after clipping with the clipping factor divided out
(each run its own: a wrong gradient elsewhere changes the norm, which is reported at the step's ``gradient`` points
as the norm, not smeared over every parameter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from titanlike.localize.cuts import DataCut
from titanlike.localize.report import Outcome, gather_outcome
from titanlike.localize.trace import Reference, Tracer

__all__ = ["trainer_problems", "run_trainer", "localize_config", "clip_then_compare", "pause_stage_inference"]


def _config(argv: list[str], world: int):
    from titanlike.config import load_config, model_args_from_config
    from titanlike.data import build_tokenizer
    from titanlike.errors import ConfigError
    from titanlike.layout import layout_violations

    cfg = load_config([*argv, "--training.dtype", "float64"], world_size=world)
    try:
        tokenizer = build_tokenizer(cfg.model.tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.tokenizer: {e}") from None
    args = model_args_from_config(cfg, tokenizer.vocab_size)
    problems = layout_violations(cfg, world, args)
    if problems:
        raise ConfigError.of(problems)
    return cfg, args, tokenizer.eos_id


def trainer_problems(argv: list[str], nproc: int) -> list[str]:
    from titanlike.errors import ConfigError

    try:
        _config(argv, nproc)
    except ConfigError as e:
        return [str(e)]
    return []


def global_batch(cfg, vocab: int, eos: int | None, step: int) -> tuple[torch.Tensor, ...]:
    """Step ``step``'s global batch (inputs, labels[, document_starts]), the same on every rank."""
    from titanlike.loss import IGNORE_INDEX

    rows, seq = cfg.training.global_batch_size, cfg.training.seq_len
    g = torch.Generator().manual_seed(cfg.training.seed * 1000 + step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    block = cfg.model.attn_mask_type == "block_causal"
    if block:
        tokens[tokens == eos] = (eos + 1) % vocab
        for row in range(rows):
            first = (5 * row + step) % max(seq // 2, 1)
            tokens[row, [first, min(seq, first + 1 + (row + step) % max(seq // 3, 1))]] = eos
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(rows):
        labels[row, : (3 * row + step) % max(seq // 2, 1)] = IGNORE_INDEX
    if not block:
        return inputs, labels
    from titanlike.models.masking import document_starts

    return inputs, labels, document_starts(inputs, eos)


# the pipeline stage's first-step metadata inference: a forward (and backward) on placeholder tensors, not a point
_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def pause_stage_inference(tracer: Tracer, stages) -> None:
    """No points while a pipeline stage infers its shapes (the first step's forward on placeholder tensors)."""
    for stage in stages:
        for name in _INFERENCE:
            if hasattr(stage, name):
                tracer.pause_during(stage, name)


def clip_then_compare(clip_fn: Callable, tracer: Tracer) -> Callable:
    """``clip_fn`` that also hands every gradient, clipping factor divided out, to the tracer."""

    def clip(params, max_norm):
        norm = clip_fn(params, max_norm)
        coef = min(1.0, max_norm / (float(norm) + 1e-6)) if max_norm > 0 else 1.0
        tracer.norm_point(float(norm))
        tracer.parameters_point("gradient", scale=1.0 / coef)
        return norm

    return clip


def _reference(cfg, args, eos, steps: int, build: Callable[[], nn.Module]) -> Reference:
    from titanlike.loss import ScaledLoss, cross_entropy_loss
    from titanlike.parallel.clip import plain_clip_grad_norm_
    from titanlike.parallel.expert_parallel import ExpertBalancing, experts_modules
    from titanlike.training.optim import build_optimizer
    from titanlike.training.step import train_step

    model = build()
    reference = Reference()
    tracer = Tracer([model], reference, compare=False)
    opt = build_optimizer([model], cfg)
    moe = ExpertBalancing([model], None, 1) if experts_modules(model) else None
    # the layout's loss as build_parallel_model sets it up: the MTP depths' losses weighted the same
    loss = ScaledLoss(partial(cross_entropy_loss, reduction="sum"), mtp_weight=cfg.training.mtp_loss_weight)
    loss.mtp_depths = getattr(args, "mtp_layers", 0) or 0
    for step in range(1, steps + 1):
        tracer.begin_step(step)
        train_step(
            [model],
            opt,
            [global_batch(cfg, args.vocab_size, eos, step)],
            loss,
            max_norm=cfg.training.max_norm,
            clip_fn=clip_then_compare(plain_clip_grad_norm_, tracer),
            moe=moe,
        )
        tracer.parameters_point("update")
    tracer.close()
    return reference


def _data_cut(cfg, dims, n_calls: int) -> tuple[DataCut, Callable]:
    """Which global rows each of this rank's calls holds, and this rank's micro-batches of a global batch."""
    from titanlike.parallel.context_parallel import cp_shard

    rows = cfg.training.global_batch_size
    dp, dp_rank = dims.dp, (dims.get_mesh("dp").get_local_rank() if dims.dp_enabled else 0)
    cp, cp_rank = (dims.cp, dims.get_mesh("cp").get_local_rank()) if dims.cp_enabled else (1, 0)
    mine = rows // dp
    per = mine // n_calls
    n_acc = cfg.training.global_batch_size // (cfg.training.local_batch_size * dp)

    def rows_of(micro: int) -> slice:
        return slice(dp_rank * mine + micro * per, dp_rank * mine + (micro + 1) * per)

    def micro_batches(*batch):
        cut = [cp_shard(t[dp_rank * mine : (dp_rank + 1) * mine], cp, cp_rank, dim=1) for t in batch]
        return list(zip(*(t.chunk(n_acc) for t in cut)))

    model_dims = {"tp": (dims.tp, dims.get_mesh("tp").get_local_rank())} if dims.tp_enabled else {}
    data = DataCut(rows, rows_of, cfg.training.seq_len, cp, cp_rank, model_dims)
    return data, micro_batches


def _validate(built, micro_batches: list[tuple]) -> None:
    """The trainer's validation forward between two steps (no grad: no point of its own), so that what it leaves
    behind (FSDP groups left unsharded, say) shows in the next step."""
    from titanlike.training.step import eval_loss_sum

    for mb in micro_batches:
        starts = mb[2] if len(mb) > 2 else None
        eval_loss_sum(built.model_parts[0], built.loss.loss_fn, mb[0], mb[1], built.forward_context, starts)


def localize_config(
    argv: list[str],
    steps: int = 2,
    tol: float = 1e-10,
    dims_cache: dict | None = None,
    around_layout: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Outcome:
    """On every rank of the process group: the layout of ``argv`` (train.py flags) against one device.

    ``dims_cache`` (a dict kept across calls) reuses the meshes of a shape, so that many calls in one process group
    create no new groups; ``around_layout`` wraps the layout's build and steps, not the one-device run (a test's
    planted bug)."""
    import torch.distributed as dist

    from titanlike.models import get_spec
    from titanlike.parallel import ParallelDims

    world = dist.get_world_size()
    cfg, args, eos = _config(argv, world)
    spec, seed = get_spec(cfg.model.name), cfg.training.seed

    def build(device: str = "cpu") -> nn.Module:
        with torch.device(device):
            model = spec.build(args).to(torch.float64)
        if device != "meta":
            model.init_weights(seed=seed)
        model.reset_position_ids = cfg.model.reset_position_ids
        return model

    reference = _reference(cfg, args, eos, steps, build)
    dims = ParallelDims.from_config(cfg, world)
    key = (dims.shape, dims.ep)
    if dims_cache is not None and key in dims_cache:
        dims = dims_cache[key]
    else:
        dims.build_mesh("cpu")
        if dims_cache is not None:
            dims_cache[key] = dims
    with around_layout():
        return _compare_layout(cfg, args, eos, dims, build, reference, steps, tol)


def _compare_layout(cfg, args, eos, dims, build, reference: Reference, steps: int, tol: float) -> Outcome:
    """The layout built as the trainer builds it, trained ``steps`` steps, every point compared with ``reference``."""
    import torch.distributed as dist

    from titanlike.parallel import build_parallel_model, loss_group
    from titanlike.parallel.coverage import uncovered_parameters
    from titanlike.training.optim import build_optimizer
    from titanlike.training.step import train_step

    seed = cfg.training.seed
    built = build_parallel_model(build("meta"), cfg, dims, torch.device("cpu"), init_seed=seed)
    n_pp = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size if built.pp else 1
    n_acc = cfg.training.global_batch_size // (cfg.training.local_batch_size * dims.dp)
    data, micro_batches = _data_cut(cfg, dims, n_acc * n_pp)
    rank = dist.get_rank()
    tracer = Tracer(built.model_parts, reference, compare=True, data=data, rank=rank, tol=tol, root=built.pp is None)
    pause_stage_inference(tracer, built.pp.stages if built.pp else [])
    opt = build_optimizer(built.model_parts, cfg)
    group = loss_group(dims)
    for step in range(1, steps + 1):
        tracer.begin_step(step)
        try:
            with tracer.counter:
                train_step(
                    built.model_parts,
                    opt,
                    micro_batches(*global_batch(cfg, args.vocab_size, eos, step)),
                    built.loss,
                    max_norm=cfg.training.max_norm,
                    clip_fn=clip_then_compare(built.clip_fn, tracer),
                    dp_group=group,
                    pp_schedule=built.pp_schedule,
                    pp_group=built.pp_group,
                    has_last_stage=built.has_last_stage,
                    forward_ctx=built.forward_context,
                    moe=built.moe,
                )
                tracer.parameters_point("update")
            if step < steps and built.pp is None:
                _validate(built, micro_batches(*global_batch(cfg, args.vocab_size, eos, steps + 1)))
        except Exception as exc:  # noqa: BLE001 - a layout that raises is a divergence, reported as one
            tracer.failed(exc)
            break
    tracer.close()
    names = dims.world_mesh.mesh_dim_names
    coords = dict(zip(names, dims.world_mesh.get_coordinate()))
    sizes = dict(zip(names, dims.world_mesh.shape))
    dp_ranks = dims.get_mesh("dp").mesh.flatten().tolist() if dims.dp_enabled else []
    uncovered = uncovered_parameters(built.model_parts, dp_ranks) if len(dp_ranks) > 1 else []
    return gather_outcome(tracer, steps, tol, coords, sizes, uncovered, n_acc * n_pp)


def run_trainer(rank: int, world: int, argv: list[str], steps: int, tol: float) -> tuple[int, str]:
    outcome = localize_config(argv, steps, tol)
    return outcome.code, outcome.text
