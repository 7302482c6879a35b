"""Pipeline schedules: which exist and how they run, read off torch's own schedule classes (no name lists).

``torch.distributed.pipelining`` knows every schedule by name (``get_schedule_class``). For each we derive, once:

* ``single_stage``: a ``PipelineScheduleSingle`` (one stage per rank: GPipe, 1F1B);
* ``v_placement``: the stage-to-rank map the schedule builds for itself puts the last stage on rank 0 (V shape:
  rank ``r`` holds stages ``r`` and ``2pp - 1 - r``; ZBVZeroBubble, DualPipeV) instead of looping
  (``r, r + pp, ...``);
* ``split_backward``: its action list has separate weight-gradient actions (``W``), i.e. each backward runs as
  an input-gradient pass and a later weight-gradient pass over the same graph (the zero-bubble schedules).
  Such schedules are incompatible with FSDP resharding after forward, op-level selective AC and compiled blocks
  (docs/facts.md, "The zero-bubble resharding trap");
* ``breadth_first``: every rank runs all its forwards before any backward (GPipe, LoopedBFS): no warm-up to fill,
  so any number of microbatches runs; the others alternate forwards and backwards in steady state;
* ``microbatch_per_stage``: torch refuses fewer microbatches than stages (1F1B, DualPipeV);
* ``microbatch_rounds``: torch runs the microbatches in rounds of pp and needs their number divisible by the
  number of rounds, ``max(1, m // pp)`` (Interleaved1F1B, InterleavedZeroBubble).

The facts come from building the schedule on stand-in stages (plain objects with the attributes its constructor
reads) for pp = 2 (one stage per rank for the single-stage schedules, two for the others): torch computes its
action lists without a process group, and its constructor refuses the microbatch counts it cannot run (probed
with one microbatch fewer than the stages, and with ``2 pp + 1``, which is not a whole number of rounds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.pipelining import schedules as _torch

__all__ = [
    "SCHEDULES",
    "ScheduleFacts",
    "StandInStage",
    "rank_of_stage",
    "schedule_class",
    "schedule_facts",
    "stage_ids_for_rank",
]


def _registered() -> tuple[str, ...]:
    """The concrete schedules torch registers by name: every public ``Schedule<Name>`` class that
    ``get_schedule_class("<Name>")`` returns (its abstract bases are not ``Schedule*``)."""
    names = []
    for attr, obj in vars(_torch).items():
        if isinstance(obj, type) and attr.startswith("Schedule") and issubclass(obj, _torch._PipelineSchedule):
            try:
                if _torch.get_schedule_class(attr[len("Schedule") :]) is obj:
                    names.append(attr[len("Schedule") :])
            except ValueError:
                continue
    return tuple(names)


SCHEDULES: tuple[str, ...] = _registered()


@dataclass(frozen=True)
class ScheduleFacts:
    name: str
    single_stage: bool
    v_placement: bool
    split_backward: bool
    breadth_first: bool
    microbatch_per_stage: bool
    microbatch_rounds: bool

    @property
    def default_stages_per_rank(self) -> int:
        return 1 if self.single_stage else 2


class StandInStage:
    """Just the attributes a PipelineScheduleMulti constructor reads from its stages: torch then computes the
    schedule's action lists (``pipeline_order``) for every rank without a process group."""

    def __init__(self, stage_index: int, num_stages: int, pp: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = 0
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_class(name: str) -> type:
    """Torch's class for schedule ``name`` (exact spelling, one of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return _torch.get_schedule_class(name)


def _build(cls, local: list[int], n_stages: int, pp: int, m: int):
    """Torch's schedule on stand-in stages ``local`` of ``n_stages`` over ``pp`` ranks, or None where its
    constructor refuses them (a placement it does not run, or ``m`` microbatches it cannot)."""
    try:
        if issubclass(cls, _torch.PipelineScheduleSingle):
            return cls(StandInStage(local[0], n_stages, pp), n_microbatches=m)
        return cls([StandInStage(s, n_stages, pp) for s in local], n_microbatches=m)
    except (ValueError, RuntimeError, AssertionError):
        return None


_COMPUTE = (_torch.FORWARD, _torch.FULL_BACKWARD, _torch.BACKWARD_INPUT, _torch.BACKWARD_WEIGHT)


def _forwards_first(actions) -> bool:
    """No forward after a backward in one rank's action list (overlapped actions count by their parts)."""
    kinds = [
        p.computation_type
        for a in actions
        if a is not None
        for p in (a.sub_actions if a.sub_actions is not None else (a,))
        if p.computation_type in _COMPUTE
    ]
    return all(k == _torch.FORWARD for k in kinds[: kinds.count(_torch.FORWARD)])


@functools.cache
def schedule_facts(name: str) -> ScheduleFacts:
    cls = schedule_class(name)
    single = issubclass(cls, _torch.PipelineScheduleSingle)
    pp = 2
    n_stages = pp if single else 2 * pp
    sched, local = None, []
    for local in ([0],) if single else ([0, 2], [0, 3]):  # loop placement first, then V (V schedules refuse loops)
        sched = _build(cls, local, n_stages, pp, m=2 * n_stages)
        if sched is not None:
            break
    if sched is None or not sched.pipeline_order:  # pragma: no cover - a torch whose schedule has no action lists
        raise RuntimeError(f"cannot derive the facts of pipeline schedule {name} from torch")
    order = sched.pipeline_order
    kinds = {a.computation_type for acts in order.values() for a in acts if a is not None}
    return ScheduleFacts(
        name,
        single_stage=single,
        v_placement=not single and sched.stage_index_to_group_rank.get(n_stages - 1) == 0,
        split_backward=_torch.BACKWARD_WEIGHT in kinds,
        breadth_first=all(_forwards_first(acts) for acts in order.values()),
        microbatch_per_stage=_build(cls, local, n_stages, pp, m=n_stages - 1) is None,
        microbatch_rounds=_build(cls, local, n_stages, pp, m=2 * pp + 1) is None,
    )


def stage_ids_for_rank(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``: loop style ``r, r+pp, ...`` or V style ``r, 2pp-1-r``."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not divide over {pp} pipeline ranks")
    if schedule_facts(schedule).v_placement:
        if n_stages != 2 * pp:
            raise ValueError(f"{schedule} needs exactly 2 stages per rank, got {n_stages} stages on {pp} ranks")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


def rank_of_stage(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding ``stage``: the inverse of :func:`stage_ids_for_rank` (V style: ``s`` for the first
    ``pp`` stages, ``2pp - 1 - s`` for the others; loop style ``s % pp``)."""
    if schedule_facts(schedule).v_placement:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp
