"""Experiment trackers beside metrics.jsonl and tensorboard: Weights & Biases (``metrics.enable_wandb``).

Rank 0 only (the :class:`~titanlike.training.metrics.MetricsLogger` holds the tracker). Every value the logger
writes to metrics.jsonl is logged at its step (losses, lr, grad norm, tokens/s, MFU, memory, MoE loads, per-source
data metrics, validation and evaluation results); the run's config is the run's ``config``. The run id is kept in
each checkpoint's checkpoint.json (``wandb_run_id``), so a resumed run continues the same run (``resume="allow"``).
The run's files go under ``<job.dump_folder>/wandb``; ``WANDB_MODE=offline`` writes them without a network
(``wandb sync`` uploads them later). wandb is the optional ``[wandb]`` extra: enabling it without the package is
refused before anything starts (:func:`wandb_problem`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import uuid
from pathlib import Path

__all__ = ["RUN_ID_KEY", "WandbTracker", "new_run_id", "wandb_problem"]

RUN_ID_KEY = "wandb_run_id"  # the checkpoint.json key holding the run id


def wandb_problem(metrics_cfg) -> str | None:
    """Why ``metrics.enable_wandb`` cannot be honoured here (None: it can, or it is off)."""
    if not metrics_cfg.enable_wandb:
        return None
    try:
        missing = importlib.util.find_spec("wandb") is None
    except ValueError:  # a module object without a spec (sys.modules["wandb"] = None)
        missing = True
    if missing:
        return "metrics.enable_wandb: the wandb package is not installed; pip install 'titanlike[wandb]'"
    return None


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class WandbTracker:
    """One wandb run: ``log(step, values)`` (numbers only; None and non-finite values are left out, as
    tensorboard's are), ``close()``."""

    def __init__(self, cfg, run_id: str, *, resumed: bool):
        import wandb

        m = cfg.metrics
        folder = Path(cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=m.wandb_project or os.environ.get("WANDB_PROJECT") or "titanlike",
            entity=m.wandb_entity or None,
            name=m.wandb_run_name or cfg.job.description or folder.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(folder),
            config=dataclasses.asdict(cfg),
        )
        self.run_id = run_id
        print(
            f"metrics: wandb run {run_id} ({'resumed' if resumed else 'new'}, {self.run.settings.mode} mode) under "
            f"{folder / 'wandb'}",
            flush=True,
        )

    def log(self, step: int, values: dict) -> None:
        numbers = {
            k: v for k, v in values.items() if isinstance(v, (int, float)) and v is not None and math.isfinite(v)
        }
        if numbers:
            self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()
