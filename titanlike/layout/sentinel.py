"""What the silent-corruption sentinel (``training.sdc_check_interval``) compares on a layout: the state that
several ranks must hold bitwise identical. One decision, read by the layout rule ``sdc`` (a sentinel on a layout
with none of it is refused: nothing to compare), the planner (its price) and the trainer's start-up line; the
sentinel itself (titanlike/training/sentinel.py) finds the same groups on the built model."""

from __future__ import annotations


def redundant_state(cfg, args) -> list[str]:
    """The kinds of identical copies a run of ``cfg`` holds, in words ([] when every rank holds its own state)."""
    p, ft = cfg.parallelism, cfg.fault_tolerance
    out = []
    if p.data_parallel_replicate_degree > 1:
        out.append(f"the {p.data_parallel_replicate_degree} HSDP replicas of every shard (dp_replicate)")
    if p.tensor_parallel_degree > 1:
        out.append(f"the tp-replicated parameters (norms) on the {p.tensor_parallel_degree} tp ranks")
    if p.pipeline_parallel_degree > 1 and getattr(args, "tie_embeddings", False):
        out.append("the copies of the tied embedding on the first and last pipeline stages")
    if ft.enable and ft.semi_sync_method == "none":
        out.append(f"rank r's state in each of the {ft.group_size} torchft replica groups")
    return out


def sdc_violations(cfg, args) -> list[str]:
    """``training.sdc_check_interval``: a non-negative integer (0: off); when on, a layout with redundant state."""
    n = cfg.training.sdc_check_interval
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return [
            f"training.sdc_check_interval {n!r} must be a positive integer (steps between two checks; 0: no checks)"
        ]
    if n and not redundant_state(cfg, args):
        semi = cfg.fault_tolerance.enable and cfg.fault_tolerance.semi_sync_method != "none"
        return [
            f"training.sdc_check_interval {n}: nothing to compare: this layout holds no state twice (no HSDP "
            f"replicas, tp 1, no tied weight across pipeline stages, "
            + (
                "replica groups that differ between synchronizations under semi_sync_method"
                if semi
                else "no torchft replica groups"
            )
            + "); raise parallelism.data_parallel_replicate_degree or tensor_parallel_degree, or drop the key"
        ]
    return []
