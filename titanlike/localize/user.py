"""``--module file.py``: a user's own module and parallelize function, against the same module on one device.

The file defines

* ``build()``: the plain single-device model, seeded (the localiser casts it to float64);
* ``parallelize(model, mesh)``: the user's own use of titanlike's or torch's parallel API on ``model`` (in place, or
  returning the parallel model); ``mesh`` is a DeviceMesh with the dims of ``MESH``;
* ``MESH``: the mesh as ``{"tp": 2}`` (dim name -> size; the product is ``--nproc``). Dims whose name starts with
  ``dp`` split the batch's rows (each rank its contiguous share, in mesh order); a dim ``cp`` splits the sequence (dim
  1 of every batch tensor as long as the labels' dim 1) into the load-balanced chunks of
  :func:`~titanlike.parallel.context_parallel.cp_shard` (``parallelize`` applies ``apply_cp`` over ``mesh["cp"]`` and
  a sum of the gradients over the cp ranks); a dim ``pp``: ``parallelize`` returns
  :func:`~titanlike.parallel.pipeline.pipeline_module`'s pipeline, trained by its schedule (each microbatch its rows);
  every other dim sees the whole batch;
* ``batch()`` (or ``batch(step)``): ``(inputs, labels)``; ``inputs`` a tensor, a tuple of tensors (positional) or a
  dict (keyword arguments); floating tensors are cast to float64;
* optionally ``loss(output, labels)``: the mean over the batch it is given (default: cross entropy over the last dim,
  labels -100 ignored). Each data-parallel rank's loss is weighted by its share of the rows (and 1 / cp), so the
  ranks' losses sum to the one-device loss (exactly when every rank holds as many counted labels): gradients must be
  *summed* over the data-parallel (and cp) ranks (``titanlike.parallel.apply_fsdp`` does; torch's averaging defaults
  show up as gradients 1/dp of the reference).

Both models take ``steps`` AdamW steps (lr ``lr``, no weight decay, no clipping) on the same batches; every point is
compared (:mod:`titanlike.localize.trace`).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.localize.cuts import DataCut
from titanlike.localize.report import gather_outcome
from titanlike.localize.trace import Reference, Tracer
from titanlike.parallel.pipeline import PipelineParallel

__all__ = ["load_user_module", "user_problems", "run_user_module"]


def load_user_module(path: str):
    spec = importlib.util.spec_from_file_location(f"titanlike_localize_user_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_problems(path: str, nproc: int) -> list[str]:
    """Every problem of a ``--module`` file (empty: usable), without starting anything."""
    if not Path(path).is_file():
        return [f"--module {path}: no such file"]
    try:
        mod = load_user_module(path)
    except Exception as exc:  # noqa: BLE001 - reported as a problem of the input
        return [f"--module {path}: importing it raised {type(exc).__name__}: {exc}"]
    out = [f"define {name}()" for name in ("build", "parallelize", "batch") if not callable(getattr(mod, name, None))]
    mesh = getattr(mod, "MESH", None)
    if (
        not isinstance(mesh, dict)
        or not mesh
        or not all(isinstance(k, str) and isinstance(v, int) and v > 0 for k, v in mesh.items())
    ):
        out.append('define MESH = {"tp": 2} (mesh dim name -> positive size)')
    elif math.prod(mesh.values()) != nproc:
        out.append(f"MESH {mesh} has {math.prod(mesh.values())} ranks, --nproc is {nproc}: make them equal")
    if getattr(mod, "loss", None) is not None and not callable(mod.loss):
        out.append("loss must be a function loss(output, labels)")
    return [f"--module {path}: {p}" for p in out]


def _f64(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _f64(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_f64(v) for v in x)
    return x


@dataclass
class _Share:
    """This rank's share of a batch: its rows of ``n_rows``, and under ``cp`` its load-balanced sequence chunks."""

    rows: slice
    n_rows: int
    cp: int = 1
    cp_rank: int = 0
    seq_len: int = 0

    def weight(self) -> float:
        """Of the one-device mean loss: this rank's share of the tokens."""
        return (self.rows.stop - self.rows.start) / self.n_rows / self.cp

    def __call__(self, x):
        if isinstance(x, torch.Tensor):
            if x.dim() and x.shape[0] == self.n_rows:
                x = x[self.rows]
            if self.cp > 1 and x.dim() > 1 and x.shape[1] == self.seq_len:
                from titanlike.parallel.context_parallel import cp_shard

                x = cp_shard(x, self.cp, self.cp_rank, dim=1)
            return x
        if isinstance(x, dict):
            return {k: self(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(self(v) for v in x)
        return x


def _call(model: nn.Module, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _default_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    return F.cross_entropy(
        logits.flatten(0, -2).float() if logits.dtype == torch.bfloat16 else logits.flatten(0, -2),
        labels.flatten(),
        ignore_index=-100,
    )


def _batch(mod, step: int):
    fn = mod.batch
    return _f64(fn(step) if len(inspect.signature(fn).parameters) else fn())


def _train(model, tracer: Tracer, mod, steps: int, lr: float, share: _Share) -> None:
    loss_fn = getattr(mod, "loss", None) or _default_loss
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(1, steps + 1):
        tracer.begin_step(step)
        inputs, labels = _batch(mod, step)
        try:
            with tracer.counter:
                opt.zero_grad(set_to_none=True)
                out = _call(model, share(inputs))
                loss = loss_fn(out, share(labels)) * share.weight()
                loss.backward()
                if not tracer.compare:  # the norm a pipeline's clip function reports is compared with it
                    tracer.norm_point(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
                tracer.parameters_point("gradient")
                opt.step()
                tracer.parameters_point("update")
        except Exception as exc:  # noqa: BLE001 - a layout that raises is a divergence, reported as one
            if not tracer.compare:
                raise
            tracer.failed(exc)
            return


def _train_pipeline(pp, tracer: Tracer, mod, steps: int, lr: float) -> None:
    """A user's :func:`~titanlike.parallel.pipeline.pipeline_module` (what ``parallelize`` returned): trained with
    the trainer's ``train_step`` over its schedule, no clipping; gradients compared after the tied copies' sum
    (``finalize_grads``), as the trainer's clip function makes it."""
    from titanlike.localize.trainer import clip_then_compare, pause_stage_inference
    from titanlike.training.step import train_step

    pause_stage_inference(tracer, pp.stages)
    opt = torch.optim.AdamW([p for m in pp.model_parts for p in m.parameters()], lr=lr, weight_decay=0.0)
    for step in range(1, steps + 1):
        tracer.begin_step(step)
        inputs, labels = _batch(mod, step)
        try:
            with tracer.counter:
                train_step(
                    pp.model_parts,
                    opt,
                    [(inputs, labels)],
                    pp.loss,
                    max_norm=0.0,
                    clip_fn=clip_then_compare(pp.finalize_grads_and_clip_, tracer),
                    pp_schedule=pp.schedule,
                    pp_group=pp.pp_group,
                    has_last_stage=pp.has_last_stage,
                )
                tracer.parameters_point("update")
        except Exception as exc:  # noqa: BLE001 - a layout that raises is a divergence, reported as one
            tracer.failed(exc)
            return


def _mesh_info(mesh) -> tuple[dict[str, int], dict[str, int], list[str]]:
    names = mesh.mesh_dim_names
    coords = dict(zip(names, mesh.get_coordinate()))
    sizes = dict(zip(names, mesh.shape))
    return coords, sizes, [n for n in names if n.startswith("dp")]


def _reduction_ranks(mesh, dims: list[str]) -> list[int]:
    """The ranks of this rank's sub-mesh over ``dims``."""
    sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    return sub.mesh.flatten().tolist()


def _dp_share(mesh, dp_dims: list[str], n_rows: int) -> tuple[slice, int, list[int]]:
    """This rank's rows, the data-parallel degree and the ranks of this rank's data-parallel group."""
    if not dp_dims:
        return slice(0, n_rows), 1, []
    sub = mesh[tuple(dp_dims)] if len(dp_dims) > 1 else mesh[dp_dims[0]]
    coords = sub.get_coordinate()
    index, dp = 0, 1
    for c, s in zip(coords, sub.shape):
        index, dp = index * s + c, dp * s
    if n_rows % dp:
        raise ValueError(f"the batch's {n_rows} rows do not split over {dp} data-parallel ranks")
    per = n_rows // dp
    return slice(index * per, (index + 1) * per), dp, sub.mesh.flatten().tolist()


def run_user_module(
    rank: int, world: int, path: str, steps: int = 2, tol: float = 1e-10, lr: float = 1e-2
) -> tuple[int, str]:
    """On every rank: one device's run of the file's model, then the parallel one compared point by point."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.parallel.coverage import uncovered_parameters

    mod = load_user_module(path)
    model = mod.build().to(torch.float64)
    parallel = copy.deepcopy(model)
    inputs, labels = _batch(mod, 1)
    n_rows = labels.shape[0]
    reference = Reference()
    tracer = Tracer([model], reference, compare=False)
    _train(model, tracer, mod, steps, lr, _Share(slice(0, n_rows), n_rows))
    tracer.close()

    mesh = init_device_mesh("cpu", tuple(mod.MESH.values()), mesh_dim_names=tuple(mod.MESH))
    parallel = mod.parallelize(parallel, mesh) or parallel
    coords, sizes, dp_dims = _mesh_info(mesh)
    if isinstance(parallel, PipelineParallel):
        return _compare_pipeline(parallel, mod, reference, rank, steps, tol, lr, n_rows, coords, sizes)
    rows, dp, dp_ranks = _dp_share(mesh, dp_dims, n_rows)
    cp, cp_rank = (sizes["cp"], coords["cp"]) if "cp" in sizes else (1, 0)
    share = _Share(rows, n_rows, cp, cp_rank, labels.shape[1] if labels.dim() > 1 else 0)
    model_dims = {n: (sizes[n], coords[n]) for n in sizes if n not in dp_dims and n != "cp"}
    data = DataCut(n_rows, lambda micro: rows, share.seq_len if cp > 1 else 0, cp, cp_rank, model_dims)
    tracer = Tracer([parallel], reference, compare=True, data=data, rank=rank, tol=tol)
    _train(parallel, tracer, mod, steps, lr, share)
    tracer.close()
    if cp > 1:  # the parameters' gradients are owed a sum over the cp ranks too
        dp_ranks = _reduction_ranks(mesh, [*dp_dims, "cp"])
    uncovered = uncovered_parameters([parallel], dp_ranks) if dp * cp > 1 else []
    outcome = gather_outcome(tracer, steps, tol, coords, sizes, uncovered)
    return outcome.code, outcome.text


def _compare_pipeline(pp, mod, reference, rank, steps, tol, lr, n_rows, coords, sizes) -> tuple[int, str]:
    """A pipeline's stages against the one-device run: each microbatch's rows, every stage module by its name in
    the full model (no hooks on the stages' roots)."""
    n_micro = pp.schedule._n_microbatches
    if n_rows % n_micro:
        raise ValueError(f"the batch's {n_rows} rows do not split into the pipeline's {n_micro} microbatches")
    per = n_rows // n_micro
    model_dims = {n: (sizes[n], coords[n]) for n in sizes if n != "pp" and not n.startswith("dp")}
    data = DataCut(n_rows, lambda micro: slice(micro * per, (micro + 1) * per), model_dims=model_dims)
    tracer = Tracer(pp.model_parts, reference, compare=True, data=data, rank=rank, tol=tol, root=False)
    _train_pipeline(pp, tracer, mod, steps, lr)
    tracer.close()
    outcome = gather_outcome(tracer, steps, tol, coords, sizes, [], n_micro)
    return outcome.code, outcome.text
