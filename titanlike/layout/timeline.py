"""The pipeline schedule simulator: when each compute action of a schedule runs on each rank (pure Python over
torch's own schedule action lists; no process group). The planner prices bubbles and in-flight activations with
it; ``titanlike.planner.schedule_plot`` draws its timelines (``scripts/plot_schedule.py``).

The per-rank order of compute actions is taken from ``torch.distributed.pipelining``
itself: the multi-stage schedules (``PipelineScheduleMulti`` subclasses) are built on
lightweight stand-in stage objects so that torch computes its ``pipeline_order``; the
single-stage schedules (GPipe, 1F1B) are replayed here exactly as their
``_step_microbatches`` loops execute them (breadth-first: every forward, then every
backward; otherwise 1F1B's warm-up, alternation and cool-down), chosen by the
schedule's facts (:func:`~titanlike.layout.schedules.schedule_facts`).

The order is then simulated with real dependencies and communication time 0:

* ``F(s, i)`` waits for ``F(s-1, i)``;
* a backward of ``s`` (full ``B`` or input-grad ``I``) waits for ``F(s, i)`` and for the
  backward of ``s+1`` for the same microbatch;
* a weight-grad ``W(s, i)`` waits for ``I(s, i)``;
* every rank runs its actions strictly in order, one at a time.

DualPipeV's overlapped ``F+B`` actions are run the way torch's runtime runs them: the
sub-actions one after the other on the rank, each as soon as its own input is there,
and their outputs are sent once the whole action is done.

Durations are per action of one stage: with ``v`` stages per rank a microbatch visits a
rank ``v`` times, so makespans grow with ``v``; compare bubble fractions, which do not
depend on the time scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from titanlike.layout.schedules import SCHEDULES, ScheduleFacts, StandInStage, schedule_class, schedule_facts

__all__ = ["KINDS", "Block", "Timeline", "bubble_formula", "canonical_schedule_name", "schedule_timeline"]

KINDS = ("F", "B", "I", "W")  # forward, full backward, input-grad, weight-grad


@dataclass(frozen=True)
class Block:
    """One compute action on one rank, placed in time."""

    kind: str  # "F" forward, "B" full backward, "I" input-grad, "W" weight-grad
    stage: int
    microbatch: int
    start: float
    end: float
    overlapped: bool = False  # part of a DualPipeV overlapped F+B action

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    schedule: str
    pp: int
    n_microbatches: int
    stages_per_rank: int
    ranks: tuple[tuple[Block, ...], ...]  # ranks[r]: blocks of rank r in execution order
    makespan: float
    stage_to_rank: dict[int, int]

    @property
    def busy_time(self) -> float:
        return sum(b.duration for blocks in self.ranks for b in blocks)

    @property
    def idle_time(self) -> float:
        return self.pp * self.makespan - self.busy_time

    @property
    def bubble_fraction(self) -> float:
        """Idle time over the whole ``pp x makespan`` rectangle."""
        return self.idle_time / (self.pp * self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over busy time: the quantity ``(pp-1)/(v*m)`` estimates."""
        return self.idle_time / self.busy_time

    @property
    def formula(self) -> float:
        return bubble_formula(self.pp, self.n_microbatches, self.stages_per_rank)


def bubble_formula(pp: int, m: int, v: int = 1) -> float:
    """Textbook bubble of (interleaved) 1F1B: ``(pp-1) / (v*m)`` (idle over busy time)."""
    return (pp - 1) / (v * m)


def canonical_schedule_name(name: str) -> str:
    """Case-insensitive lookup of a schedule name; ``ValueError`` lists the valid ones."""
    for s in SCHEDULES:
        if s.lower() == name.lower():
            return s
    raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}")


# --------------------------------------------------------------------------- orders


class _Op(NamedTuple):
    kind: str
    stage: int
    microbatch: int


# One rank-level action: a single op, or several ops run as one (DualPipeV OVERLAP_F_B).
_Action = tuple[_Op, ...]


def _single_stage_order(facts: ScheduleFacts, pp: int, m: int) -> dict[int, list[_Action]]:
    """The order ScheduleGPipe (breadth-first) / Schedule1F1B ``_step_microbatches`` run on each rank."""
    order: dict[int, list[_Action]] = {}
    for rank in range(pp):
        ops: list[_Op] = []
        if facts.breadth_first:
            ops += [_Op("F", rank, i) for i in range(m)]
            ops += [_Op("B", rank, i) for i in range(m)]
        else:  # 1F1B: warmup forwards, then B/F pairs until forwards run out, then B
            warmup = min(m, pp - rank)
            ops += [_Op("F", rank, i) for i in range(warmup)]
            fwd, bwd = warmup, 0
            while True:
                ops.append(_Op("B", rank, bwd))
                bwd += 1
                if fwd == m:
                    break
                ops.append(_Op("F", rank, fwd))
                fwd += 1
            ops += [_Op("B", rank, i) for i in range(bwd, m)]
        order[rank] = [(op,) for op in ops]
    return order


def _multi_stage_order(schedule: str, pp: int, m: int, v: int) -> tuple[dict[int, list[_Action]], dict[int, int]]:
    num_stages = pp * v
    local = [r for r in range(num_stages) if r % pp == 0]  # loop: rank 0 holds 0, pp, ...
    if schedule_facts(schedule).v_placement:
        local = [0, num_stages - 1]
    stages = [StandInStage(s, num_stages, pp) for s in local]
    sched = schedule_class(schedule)(stages, n_microbatches=m)

    def convert(a) -> _Action | None:
        if a is None:
            return None
        parts = a.sub_actions if a.sub_actions is not None else (a,)
        ops = tuple(
            _Op(p.computation_type.value, p.stage_index, p.microbatch_index)
            for p in parts
            if p.computation_type.value in KINDS
        )
        return ops or None

    order = {rank: [op for op in map(convert, sched.pipeline_order[rank]) if op is not None] for rank in range(pp)}
    return order, dict(sched.stage_index_to_group_rank)


# ----------------------------------------------------------------------- simulation


def _simulate(order: dict[int, list[_Action]], num_stages: int, durations: dict[str, float]) -> list[list[Block]]:
    ready: dict[_Op, float] = {}  # op -> time its result is available to other ops

    def deps(op: _Op) -> list[_Op]:
        s, i = op.stage, op.microbatch
        if op.kind == "F":
            return [_Op("F", s - 1, i)] if s > 0 else []
        if op.kind == "W":
            return [_Op("I", s, i)]
        out = [_Op("F", s, i)]  # B or I
        if s < num_stages - 1:
            nxt = _Op("B", s + 1, i)
            out.append(nxt if nxt in ready else _Op("I", s + 1, i))
        return out

    blocks: list[list[Block]] = [[] for _ in order]
    pos = {rank: 0 for rank in order}
    free = {rank: 0.0 for rank in order}
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progress = False
        for rank, actions in order.items():
            while pos[rank] < len(actions):
                action = actions[pos[rank]]
                needs = [d for op in action for d in deps(op) if d not in action]
                if not all(d in ready for d in needs):
                    break
                t, placed = free[rank], []
                for op in action:
                    start = max([t] + [ready[d] for d in deps(op) if d in ready])
                    t = start + durations[op.kind]
                    placed.append(Block(op.kind, op.stage, op.microbatch, start, t, len(action) > 1))
                for op in action:  # results leave the rank when the whole action is done
                    if op in ready:
                        raise ValueError(f"{op} scheduled twice")
                    ready[op] = t
                blocks[rank] += placed
                free[rank] = t
                pos[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {r: order[r][pos[r]] for r in order if pos[r] < len(order[r])}
            raise RuntimeError(f"schedule deadlocks; next actions per rank: {stuck}")
    return blocks


def schedule_timeline(
    schedule: str,
    pp: int,
    n_microbatches: int,
    stages_per_rank: int = 1,
    f_time: float = 1.0,
    b_time: float = 2.0,
    w_time: float | None = None,
) -> Timeline:
    """Simulate ``schedule`` on ``pp`` ranks with ``n_microbatches`` microbatches.

    ``f_time`` / ``b_time`` are the forward / full-backward time of one stage. Zero-bubble
    schedules split the backward into ``I`` (``b_time - w_time``) and ``W`` (``w_time``,
    default ``b_time / 2``).
    """
    schedule = canonical_schedule_name(schedule)
    v = stages_per_rank
    if pp < 1 or n_microbatches < 1 or v < 1:
        raise ValueError("pp, n_microbatches and stages_per_rank must be >= 1")
    facts = schedule_facts(schedule)
    if facts.single_stage and v != 1:
        raise ValueError(f"{schedule} is a single-stage schedule: stages_per_rank must be 1")
    if facts.v_placement and v != 2:
        raise ValueError(f"{schedule} places stages in a V: stages_per_rank must be 2")
    if facts.microbatch_per_stage and n_microbatches < pp * v:
        raise ValueError(f"{schedule} needs n_microbatches >= its {pp * v} stages, got {n_microbatches}")
    if w_time is None:
        w_time = b_time / 2
    if not (f_time > 0 and 0 < w_time < b_time):
        raise ValueError("need f_time > 0 and 0 < w_time < b_time")
    durations = {"F": f_time, "B": b_time, "I": b_time - w_time, "W": w_time}

    if facts.single_stage:
        order = _single_stage_order(facts, pp, n_microbatches)
        stage_to_rank = {r: r for r in range(pp)}
    else:
        order, stage_to_rank = _multi_stage_order(schedule, pp, n_microbatches, v)

    blocks = _simulate(order, pp * v, durations)
    makespan = max(b.end for rank_blocks in blocks for b in rank_blocks)
    return Timeline(
        schedule=schedule,
        pp=pp,
        n_microbatches=n_microbatches,
        stages_per_rank=v,
        ranks=tuple(tuple(b) for b in blocks),
        makespan=makespan,
        stage_to_rank=stage_to_rank,
    )
