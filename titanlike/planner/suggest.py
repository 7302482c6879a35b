"""Enumerate the legal layouts of a model on a world size and rank them by estimated step time.

The global batch (sequences per optimizer step) and sequence length are the configuration's and stay fixed, so
every candidate trains the same tokens per step and step times compare directly. For each
(tp, pp, dp_shard, dp_replicate, schedule, microbatch) the candidate takes the least activation checkpointing that
fits in memory (none, then selective op-level, then full) and, without pipelining, the fewest gradient
accumulation steps that fit. Sequence parallelism is on whenever tp > 1 (same bytes as plain TP, less memory).
The context-parallel degree is the configuration's (the ranks left for the others are ``world / cp``); under
cp > 1 every layout is tried with each context-parallel method (all-gather K/V, all-to-all over heads) the rules
allow, and the faster one that fits is ranked.
Layouts whose tp groups span nodes are kept but marked: the ranking shows what they cost.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from titanlike.config import JobConfig
from titanlike.layout import layout_violations, schedule_facts
from titanlike.parallel.context_parallel import METHODS as CP_METHODS
from titanlike.planner.cost import step_cost
from titanlike.planner.hardware import Hardware
from titanlike.planner.layout import Layout
from titanlike.planner.memory import rank_memory

__all__ = ["Candidate", "suggest_layouts"]

# the schedules tried, with their stages per rank (one single-stage, one interleaved, one V)
_SCHEDULES = tuple((s, schedule_facts(s).default_stages_per_rank) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"))
_AC = (("none", "op"), ("selective", "op"), ("full", "op"))
_ENDS = ((0, 0), (1, 1), (0, 1), (1, 0), (2, 2), (0, 2), (2, 0))  # embedding / head weights to even the split


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp_shard: int
    dp_replicate: int
    schedule: str
    stages_per_rank: int
    microbatch: int
    local_batch: int
    accum_steps: int
    ac: str
    memory: float  # bytes on the most loaded rank
    step_time: float
    mfu: float
    bubble: float
    tp_spans_nodes: bool
    overrides: tuple[str, ...]  # command-line options that turn the base config into this layout
    cp: int = 1  # the configuration's context-parallel degree
    cp_method: str = "allgather"  # parallelism.context_parallel_method


def _cp_method_sets(cp: int) -> list[dict]:
    """The context-parallel methods tried for cp ranks: every method (hybrid with each all-to-all group size
    strictly between 1 and cp that divides cp); only the default at cp 1."""
    if cp == 1:
        return [{"parallelism.context_parallel_method": "allgather"}]
    out = [{"parallelism.context_parallel_method": m} for m in CP_METHODS if m != "hybrid"]
    return out + [
        {"parallelism.context_parallel_method": "hybrid", "parallelism.context_parallel_a2a_degree": a}
        for a in _divisors(cp)
        if 1 < a < cp
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configure(base: JobConfig, sets: dict[str, object]) -> JobConfig:
    cfg = copy.deepcopy(base)
    for dotted, value in sets.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


def _overrides(base: JobConfig, sets: dict[str, object]) -> tuple[str, ...]:
    """The command-line options that change ``base`` into the candidate (values equal to base's left out)."""
    out = []
    for k, v in sets.items():
        section, key = k.split(".")
        if getattr(getattr(base, section), key) == v:
            continue
        if isinstance(v, list):
            v = ";".join(v)
        out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return tuple(out)


def suggest_layouts(
    cfg: JobConfig, world_size: int, hardware: Hardware, args, *, global_batch: int, max_tp: int | None = None
) -> tuple[list[Candidate], dict[str, int]]:
    """All fitting layouts, fastest first, and counts: layouts considered, and rejected as illegal
    (titanlike.layout.layout_violations, with the base config's other settings, e.g. compile) or over
    memory even with full activation checkpointing."""
    stats = {"layouts": 0, "illegal": 0, "out of memory": 0}
    found: list[Candidate] = []
    cp = cfg.parallelism.context_parallel_degree
    cp_methods = _cp_method_sets(cp)
    world_size, full_world = world_size // cp, world_size  # the ranks the other degrees divide
    tps = [
        t
        for t in _divisors(world_size)
        if t <= (max_tp or world_size)
        and args.n_heads % t == 0
        and args.n_kv_heads % t == 0
        and args.hidden_dim % t == 0
        and args.vocab_size % t == 0
    ]
    for tp in tps:
        for pp in [p for p in _divisors(world_size // tp) if p <= args.n_layers]:
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            shards = sorted({dp} | {s for s in (8, 32, 128) if s < dp and dp % s == 0}, reverse=True)
            for dp_shard in shards:
                for schedule, v in _SCHEDULES if pp > 1 else (("1F1B", 1),):
                    for mbs in (1, 2, 4) if pp > 1 else (1,):
                        tried = [
                            _best(
                                cfg,
                                full_world,
                                hardware,
                                args,
                                global_batch,
                                tp,
                                pp,
                                dp_shard,
                                dp // dp_shard,
                                schedule,
                                v,
                                mbs,
                                stats,
                                {"parallelism.context_parallel_degree": cp, **method},
                            )
                            for method in cp_methods
                        ]
                        found += [c for c in tried if c is not None]
    found.sort(key=lambda c: c.step_time)
    return found, stats


def _layout_sets(
    tp, pp, dp_shard, dp_replicate, local, global_batch, ac, option, schedule, mbs, v, ends, cp_sets
) -> dict:
    """The config keys that make the candidate layout (the pipeline's only under pp)."""
    sets = {
        "parallelism.tensor_parallel_degree": tp,
        "parallelism.enable_sequence_parallel": tp > 1,
        "parallelism.pipeline_parallel_degree": pp,
        "parallelism.data_parallel_shard_degree": dp_shard,
        "parallelism.data_parallel_replicate_degree": dp_replicate,
        "training.local_batch_size": local,
        "training.global_batch_size": global_batch,
        "activation_checkpoint.mode": ac,
        "activation_checkpoint.selective_ac_option": option,
        **cp_sets,  # the context-parallel degree and method
    }
    if pp > 1:
        sets.update(
            {
                "parallelism.pipeline_parallel_schedule": schedule,
                "parallelism.pipeline_parallel_microbatch_size": mbs,
                "parallelism.pipeline_parallel_stages_per_rank": v,
                "parallelism.pipeline_parallel_layers_per_stage": 0,
                "parallelism.pipeline_parallel_module_names": [],
                "parallelism.pipeline_parallel_first_stage_less_layers": ends[0],
                "parallelism.pipeline_parallel_last_stage_less_layers": ends[1],
            }
        )
    return sets


def _best(
    cfg, world_size, hw: Hardware, args, global_batch, tp, pp, dp_shard, dp_replicate, schedule, v, mbs, stats, cp_sets
) -> Candidate | None:
    stats["layouts"] += 1
    dp = dp_shard * dp_replicate
    accums = [1] if pp > 1 else [a for a in _divisors(global_batch // dp)]
    n_stages = pp * v
    ends = (
        next(
            (
                (f, l)
                for f, l in _ENDS
                if (args.n_layers + f + l) % n_stages == 0 and (args.n_layers + f + l) // n_stages > max(f, l)
            ),
            None,
        )
        if pp > 1
        else (0, 0)
    )
    if ends is None:
        stats["illegal"] += 1
        return None
    legal = False
    for accum in accums:
        local = global_batch // (dp * accum)
        for ac, option in _AC:
            sets = _layout_sets(
                tp, pp, dp_shard, dp_replicate, local, global_batch, ac, option, schedule, mbs, v, ends, cp_sets
            )
            cand_cfg = _configure(cfg, sets)
            if layout_violations(cand_cfg, world_size, args):  # e.g. op-level AC under a zero-bubble schedule
                continue
            legal = True
            lo = Layout.from_config(cand_cfg, world_size, args, hw.gpus_per_node)
            per_pp = world_size // pp
            memory = max(sum(it.bytes for it in rank_memory(lo, args, r)) for r in {0, (pp - 1) * per_pp})
            if memory > hw.usable_memory:
                continue
            cost = step_cost(lo, args, hw)
            return Candidate(
                tp,
                pp,
                dp_shard,
                dp_replicate,
                schedule if pp > 1 else "",
                v,
                mbs if pp > 1 else local,
                local,
                accum,
                ac if ac != "selective" else "selective op",
                memory,
                cost.step_time,
                cost.mfu,
                cost.bubble,
                lo.groups["tp"].crosses_nodes,
                _overrides(cfg, sets),
                lo.cp,
                lo.cp_method if lo.cp_method != "hybrid" else f"hybrid a2a {lo.cp_a2a}",
            )
    stats["out of memory" if legal else "illegal"] += 1
    return None
