"""Layout planner: validate, price and dry-run any parallel layout at any scale before a GPU is allocated.

    from titanlike.planner import hardware_for, make_plan, render_plan, suggest_layouts
    plan = make_plan(cfg, world_size=16384, hardware=hardware_for("H100"), args=model_args)
    print(render_plan(plan))

``scripts/plan.py`` is the command line; docs/planner.md explains the output and every formula.
"""

from titanlike.planner.cost import Message, StepCost, bubble, messages, step_cost
from titanlike.planner.dryrun import DryRun, dry_run
from titanlike.planner.hardware import GPUS, Hardware, hardware_for
from titanlike.planner.layout import GroupMap, Layout, group_map
from titanlike.planner.memory import MemoryItem, block_activation_bytes, rank_memory, rank_param_shards
from titanlike.planner.plan import Plan, fmt_bytes, make_plan, render_plan
from titanlike.planner.suggest import Candidate, suggest_layouts

__all__ = [
    "GPUS",
    "Candidate",
    "DryRun",
    "GroupMap",
    "Hardware",
    "Layout",
    "MemoryItem",
    "Message",
    "Plan",
    "StepCost",
    "block_activation_bytes",
    "bubble",
    "dry_run",
    "fmt_bytes",
    "group_map",
    "hardware_for",
    "make_plan",
    "messages",
    "rank_memory",
    "rank_param_shards",
    "render_plan",
    "step_cost",
    "suggest_layouts",
]
