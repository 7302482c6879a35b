"""How the model splits into pipeline stages: stage count, module names per stage (torchtitan's split or by hand).

Stage ``s`` holds a contiguous slice of ``layers.*``; the first stage also the embedding, the last the final norm
and the output head (and computes the loss). By default the blocks are split as torchtitan's
``generate_llm_fqn_per_model_part`` splits them: the embedding / head count as
``pipeline_parallel_first/last_stage_less_layers`` blocks, each stage gets ``units // stages`` of the weighted units
and the first ``units % stages`` stages one more (61 blocks over 8 stages: 8 8 8 8 8 7 7 7), so any layer count
splits unless a stage would be empty; ``pipeline_parallel_module_names`` lists the modules of every stage by hand.
Which stages a rank holds: ``titanlike.layout.schedules.stage_ids_for_rank``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from titanlike.errors import ConfigError
from titanlike.layout.schedules import schedule_facts
from titanlike.models import DEFAULT_MODEL, ModelSpec, get_spec

__all__ = [
    "describe_split",
    "parse_module_names",
    "pipeline_stage_count",
    "split_module_names",
    "split_problem",
    "stage_module_names",
]


def _spec(spec: ModelSpec | None) -> ModelSpec:
    return spec if spec is not None else get_spec(DEFAULT_MODEL)


def pipeline_stage_count(cfg, args) -> int:
    """Total number of pipeline stages (pp x virtual stages per rank)."""
    p = cfg.parallelism
    pp = p.pipeline_parallel_degree
    if p.pipeline_parallel_module_names:
        return len(p.pipeline_parallel_module_names)
    if p.pipeline_parallel_stages_per_rank:
        return pp * p.pipeline_parallel_stages_per_rank
    if p.pipeline_parallel_layers_per_stage:  # torchtitan's count: the last stages may hold one block fewer
        eff = args.n_layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
        return max(1, -(-eff // p.pipeline_parallel_layers_per_stage))
    return pp * schedule_facts(p.pipeline_parallel_schedule).default_stages_per_rank


def split_problem(n_layers: int, n_stages: int, first_less: int = 0, last_less: int = 0) -> str | None:
    """Why ``n_layers`` blocks cannot go into ``n_stages`` stages (None: they can): a stage would be empty, or the
    embedding / head weighs more than a stage's share (torchtitan's two refusals), with values that work."""
    eff = n_layers + first_less + last_less
    what = f"{n_layers} layers (+{first_less} for the embedding, +{last_less} for the head)"
    if n_stages < 1 or eff < n_stages:
        return (
            f"pipeline: {what} leave a stage empty in {n_stages} stages; use at most {eff} stages "
            f"(pipeline_parallel_degree x stages per rank) or a model with at least {n_stages - first_less - last_less}"
            f" layers"
        )
    per = eff // n_stages
    heavy = [(k, w) for k, w in (("first", first_less), ("last", last_less)) if w > per]
    if heavy:
        keys = " and ".join(f"pipeline_parallel_{k}_stage_less_layers {w}" for k, w in heavy)
        return (
            f"pipeline: {keys} weigh{'s' * (len(heavy) == 1)} more than a stage's {per} layers ({what} in "
            f"{n_stages} stages); use at most {per}, or fewer stages"
        )
    return None


def split_module_names(
    n_layers: int, n_stages: int, first_less: int = 0, last_less: int = 0, *, spec: ModelSpec | None = None
) -> list[list[str]]:
    """Module names of each of ``n_stages`` stages: torchtitan's ``generate_llm_fqn_per_model_part``.

    The embedding counts as ``first_less`` blocks and the norm + head as ``last_less`` blocks; the ``n_layers +
    first_less + last_less`` units split into ``n_stages`` shares of ``units // n_stages``, the first
    ``units % n_stages`` stages one more; the end stages hold their share less their weight in blocks:
    6 layers, 4 stages, 1 + 1 -> [emb, 0], [1, 2], [3, 4], [5, head]; 61 layers, 8 stages -> 8 8 8 8 8 7 7 7 blocks.
    An end stage may hold no block (the embedding or the head alone); no stage is empty (:func:`split_problem`).
    """
    problem = split_problem(n_layers, n_stages, first_less, last_less)
    if problem:
        raise ConfigError(problem)
    eff = n_layers + first_less + last_less
    per, extra = divmod(eff, n_stages)
    counts = [
        per + (s < extra) - (first_less if s == 0 else 0) - (last_less if s == n_stages - 1 else 0)
        for s in range(n_stages)
    ]
    assert sum(counts) == n_layers and min(counts) >= 0, counts
    spec = _spec(spec)
    names, start = [], 0
    for s, count in enumerate(counts):
        stage = list(spec.input_modules) if s == 0 else []
        stage += [f"{spec.block_container}.{i}" for i in range(start, start + count)]
        start += count
        if s == n_stages - 1:
            stage += list(spec.output_modules)
        names.append(stage)
    return names


def describe_split(stages: Sequence[Sequence[str]], *, spec: ModelSpec | None = None) -> str:
    """One line naming every stage's modules, the blocks as ranges: ``[tok_embeddings, layers.0-7] [layers.8-15]
    ... [layers.54-60, norm, output]`` (the planner and the trainer's start-up print it)."""
    spec = _spec(spec)
    prefix = spec.block_container + "."
    parts = []
    for names in stages:
        ids = [int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()]
        others = [n for n in names if not (n.startswith(prefix) and n[len(prefix) :].isdigit())]
        first = [n for n in others if n in spec.input_modules]
        rest = [n for n in others if n not in spec.input_modules]
        blocks = []
        if ids:
            contiguous = ids == list(range(ids[0], ids[-1] + 1))
            if contiguous:
                blocks = [f"{prefix}{ids[0]}" + (f"-{ids[-1]}" if len(ids) > 1 else "")]
            else:
                blocks = [f"{prefix}{i}" for i in ids]
        parts.append("[" + ", ".join([*first, *blocks, *rest]) + "]")
    counts = [sum(n.startswith(prefix) for n in names) for names in stages]
    return f"blocks per stage {' '.join(map(str, counts))}: {' '.join(parts)}"


def parse_module_names(specs: Sequence[str], n_layers: int, *, spec: ModelSpec | None = None) -> list[list[str]]:
    """``pipeline_parallel_module_names`` (one comma-separated string per stage) -> module names per stage.

    Every block appears exactly once and in order; the embedding is on the first stage, the norm and the head
    together on the last; no stage is empty.
    """
    key = "parallelism.pipeline_parallel_module_names"
    spec = _spec(spec)
    layer_re = re.compile(re.escape(spec.block_container) + r"\.(\d+)")
    first, last = spec.input_modules, spec.output_modules
    stages = [[n.strip() for n in spec_.split(",") if n.strip()] for spec_ in specs]
    if len(stages) < 2:
        raise ConfigError(f"{key}: give at least 2 stages (one comma-separated string of module names each)")
    layers: list[int] = []
    for s, names in enumerate(stages):
        if not names:
            raise ConfigError(f"{key}: stage {s} is empty; every stage needs at least one module")
        for name in names:
            m = layer_re.fullmatch(name)
            if m:
                layers.append(int(m.group(1)))
            elif name in first:
                if s != 0:
                    raise ConfigError(f"{key}: {name} must be on the first stage, found on stage {s}")
            elif name in last:
                if s != len(stages) - 1:
                    raise ConfigError(f"{key}: {name} must be on the last stage, found on stage {s}")
            else:
                raise ConfigError(
                    f"{key}: unknown module '{name}' on stage {s}; valid: {', '.join(first)}, "
                    f"{spec.block_container}.<i> (0 <= i < {n_layers}), {', '.join(last)}"
                )
    if layers != list(range(n_layers)):
        c = spec.block_container
        raise ConfigError(
            f"{key}: the stages must list {c}.0 .. {c}.{n_layers - 1} each exactly once and in "
            f"order, got {', '.join(f'{c}.{i}' for i in layers)}"
        )
    for name, s in [*((n, 0) for n in first), *((n, -1) for n in last)]:
        if sum(n == name for names in stages for n in names) != 1 or name not in stages[s]:
            raise ConfigError(f"{key}: {name} must appear exactly once, on the {'first' if s == 0 else 'last'} stage")
    return stages


def stage_module_names(cfg, args) -> list[list[str]]:
    """The module names of every pipeline stage for this configuration (raises ConfigError on a bad layout)."""
    p = cfg.parallelism
    spec = get_spec(cfg.model.name)
    if p.pipeline_parallel_module_names:
        return parse_module_names(p.pipeline_parallel_module_names, args.n_layers, spec=spec)
    return split_module_names(
        args.n_layers,
        pipeline_stage_count(cfg, args),
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
        spec=spec,
    )
