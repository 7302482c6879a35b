"""The layout layer: plain data and pure functions that decide what a parallel layout is, with no process group.

Imported by config, parallel, planner, trainer and scripts; imports none of them (only ``titanlike.models``, and
torch for the pipeline schedule classes). It owns

* the degree arithmetic and the rank grid (:mod:`~titanlike.layout.degrees`);
* every cross-field validation rule (:mod:`~titanlike.layout.rules`; ``config.py`` keeps the schema, parsing and
  per-key ranges);
* the pipeline schedule facts, derived from torch's schedule classes (:mod:`~titanlike.layout.schedules`), the
  schedule simulator over torch's action lists (:mod:`~titanlike.layout.timeline`; the planner prices bubbles and
  activations with it) and the stage split (:mod:`~titanlike.layout.stages`);
* the precision policy, the FSDP reshard policy, the activation-checkpointing option grammar and the batch /
  accumulation arithmetic (:mod:`~titanlike.layout.policy`).

The trainer and the parallelize functions act on these decisions; the planner prices them.
"""

from titanlike.layout.degrees import (
    FLATTENED,
    MESH_DIMS,
    TOKEN_DIMS,
    Degrees,
    degree_problems,
    describe_layout,
    expert_degree_problem,
    expert_groups,
    rank_groups,
    rank_of,
)
from titanlike.layout.float8 import (
    FLOAT8_RECIPES,
    TE_FLOAT8_RECIPES,
    TORCHAO_FLOAT8_RECIPES,
    float8_backend,
    float8_violations,
)
from titanlike.layout.policy import (
    FSDP_GROUPS,
    RESHARD_CHOICES,
    BatchSplit,
    ac_block_mode,
    batch_split,
    canonical_microbatch_size,
    loss_parallel_enabled,
    master_dtype,
    parse_ac_option,
    precision_policy,
    reshard_after_forward,
    virtual_dp_degree,
)
from titanlike.layout.rules import RULES, layout_violations
from titanlike.layout.schedules import (
    SCHEDULES,
    ScheduleFacts,
    rank_of_stage,
    schedule_class,
    schedule_facts,
    stage_ids_for_rank,
)
from titanlike.layout.sentinel import redundant_state
from titanlike.layout.stages import (
    describe_split,
    parse_module_names,
    pipeline_stage_count,
    split_module_names,
    split_problem,
    stage_module_names,
)
from titanlike.layout.timeline import Block, Timeline, bubble_formula, canonical_schedule_name, schedule_timeline

__all__ = [
    "redundant_state",
    "FLOAT8_RECIPES",
    "TE_FLOAT8_RECIPES",
    "TORCHAO_FLOAT8_RECIPES",
    "float8_backend",
    "float8_violations",
    "BatchSplit",
    "Block",
    "Timeline",
    "bubble_formula",
    "canonical_schedule_name",
    "schedule_timeline",
    "Degrees",
    "FLATTENED",
    "FSDP_GROUPS",
    "MESH_DIMS",
    "TOKEN_DIMS",
    "RESHARD_CHOICES",
    "RULES",
    "SCHEDULES",
    "ScheduleFacts",
    "ac_block_mode",
    "batch_split",
    "canonical_microbatch_size",
    "degree_problems",
    "describe_layout",
    "describe_split",
    "expert_degree_problem",
    "expert_groups",
    "layout_violations",
    "loss_parallel_enabled",
    "master_dtype",
    "parse_ac_option",
    "parse_module_names",
    "pipeline_stage_count",
    "precision_policy",
    "rank_groups",
    "rank_of_stage",
    "rank_of",
    "reshard_after_forward",
    "virtual_dp_degree",
    "schedule_class",
    "schedule_facts",
    "split_module_names",
    "split_problem",
    "stage_ids_for_rank",
    "stage_module_names",
]
