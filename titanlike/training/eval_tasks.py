"""The ``[eval]`` section: lm-evaluation-harness tasks every ``eval.freq`` steps, on the training layout.

Every rank runs every request on its own shards (FSDP gathers each block's parameters as in a training forward, a
tensor-parallel head's logits are gathered; nothing of the model is gathered to one rank) and gets the same scores;
rank 0 logs each task's metrics (``eval/<task>/<metric>``) to the console, metrics.jsonl and the trackers. Layouts
it cannot run on are refused before anything starts (:func:`eval_problems`): pipeline parallelism (a forward is a
schedule of stages), context parallelism (its attention needs sequence chunks), ``model.reset_position_ids`` (no
document starts in a task's text), and tasks that generate under sequence parallelism (a one-token decode step
cannot be split over the sequence). Under sequence parallelism the scored batches are right-padded to a multiple
of the tp degree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["EVAL_EXTRA", "eval_problems", "run_eval"]

EVAL_EXTRA = "pip install 'titanlike[eval]'"


def _lm_eval_missing() -> bool:
    try:
        return importlib.util.find_spec("lm_eval") is None
    except ValueError:
        return True


def _layout_problems(cfg) -> list[str]:
    p = cfg.parallelism
    out = []
    if p.pipeline_parallel_degree > 1:
        out.append(f"pipeline parallelism (pp {p.pipeline_parallel_degree}): a forward there is a schedule of stages")
    if p.context_parallel_degree > 1:
        out.append(f"context parallelism (cp {p.context_parallel_degree}): its attention needs sequence chunks")
    if cfg.model.reset_position_ids:
        out.append("model.reset_position_ids: a task's text carries no document starts")
    return out


def eval_problems(cfg) -> list[str]:
    """Why ``[eval]`` cannot run as configured (one line each; empty when it can or is off)."""
    e = cfg.eval
    if not e.enable:
        return []
    if _lm_eval_missing():
        return [f"eval.enable: lm-evaluation-harness is not installed; {EVAL_EXTRA}"]
    out = [f"eval.enable: the layout cannot run it: {why}; set eval.enable = false" for why in _layout_problems(cfg)]
    if not e.tasks:
        out.append("eval.tasks is empty; name tasks (e.g. eval.tasks = ['shakespeare_next_line'])")
    missing = [f for f in e.include if not Path(f).is_dir()]
    out += [f"eval.include: '{f}' is not a folder of task YAMLs" for f in missing]
    if out or missing:
        return out
    from titanlike.evaluation import task_manager

    index = task_manager(e.include).task_index
    unknown = [t for t in e.tasks if t not in index]
    if unknown:
        out.append(f"eval.tasks: unknown task(s) {unknown}; local tasks: {', '.join(sorted(index)) or 'none'}")
    if cfg.parallelism.enable_sequence_parallel:
        generating = [t for t in e.tasks if t in index and (index[t].cfg or {}).get("output_type") == "generate_until"]
        if generating:
            out.append(
                f"eval.tasks {generating} generate text, which sequence parallelism cannot (a one-token decode step "
                f"is not split over the sequence); score them after training with scripts/eval.py"
            )
    return out


def run_eval(cfg, model, tokenizer, forward_context, seed: int) -> dict[str, float]:
    """Every ``eval.tasks`` task on ``model`` (this rank's part of the training layout): ``eval/<task>/<metric>``,
    the same on every rank. Collective: every rank calls it at the same step."""
    from titanlike.evaluation import TitanlikeLM, evaluate, task_metrics
    from titanlike.training.step import reshard_fsdp

    e, p = cfg.eval, cfg.parallelism
    lm = TitanlikeLM(
        model=model,
        tokenizer=tokenizer,
        batch_size=e.batch_size,
        max_length=cfg.training.seq_len,
        pad_multiple=p.tensor_parallel_degree if p.enable_sequence_parallel else 1,
    )
    try:
        with forward_context():
            results = evaluate(lm, e.tasks, include=e.include, limit=e.limit or None, seed=seed)
    finally:
        model.train()
        reshard_fsdp(model)
    return task_metrics(results)
