"""Pictures of pipeline-parallel schedules.

The per-rank order of compute actions is taken from ``torch.distributed.pipelining``
itself: the multi-stage schedules (``PipelineScheduleMulti`` subclasses) are built on
lightweight stand-in stage objects so that torch computes its ``pipeline_order``; the
single-stage schedules (GPipe, 1F1B) are replayed here exactly as their
``_step_microbatches`` loops execute them.

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

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from titanlike.layout import SCHEDULES, schedule_class, schedule_facts
from titanlike.layout.schedules import StandInStage

__all__ = [
    "SCHEDULES",
    "Block",
    "Timeline",
    "bubble_formula",
    "canonical_schedule_name",
    "render_png",
    "render_text",
    "schedule_timeline",
]

_KINDS = ("F", "B", "I", "W")


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


def _single_stage_order(schedule: str, pp: int, m: int) -> dict[int, list[_Action]]:
    """The order ScheduleGPipe / Schedule1F1B ``_step_microbatches`` run on each rank."""
    order: dict[int, list[_Action]] = {}
    for rank in range(pp):
        ops: list[_Op] = []
        if schedule == "GPipe":
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
            if p.computation_type.value in _KINDS
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
    if schedule == "1F1B" and n_microbatches < pp:
        raise ValueError(f"1F1B needs n_microbatches >= pp, got {n_microbatches} < {pp}")
    if w_time is None:
        w_time = b_time / 2
    if not (f_time > 0 and 0 < w_time < b_time):
        raise ValueError("need f_time > 0 and 0 < w_time < b_time")
    durations = {"F": f_time, "B": b_time, "I": b_time - w_time, "W": w_time}

    if facts.single_stage:
        order = _single_stage_order(schedule, pp, n_microbatches)
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


# ------------------------------------------------------------------------ rendering


def _chunk(tl: Timeline, rank: int, stage: int) -> int:
    """Index of ``stage`` among the stages held by ``rank`` (0 = its first stage)."""
    return sorted(s for s, r in tl.stage_to_rank.items() if r == rank).index(stage)


def _time_unit(tl: Timeline) -> float:
    """Largest time step that every block boundary falls on."""
    durs = {Fraction(b.duration).limit_denominator(1000) for bl in tl.ranks for b in bl}
    num = math.gcd(*(d.numerator for d in durs))
    den = math.lcm(*(d.denominator for d in durs))
    return num / den


def _title(tl: Timeline) -> str:
    return f"{tl.schedule}  pp={tl.pp}  microbatches={tl.n_microbatches}  stages/rank={tl.stages_per_rank}"


def _stats(tl: Timeline) -> str:
    return (
        f"bubble {tl.bubble_fraction:.3f} of pp*makespan (idle/busy {tl.bubble_ratio:.3f}); "
        f"formula (pp-1)/(v*m) = {tl.formula:.3f}"
    )


def render_text(tl: Timeline, unit: float | None = None) -> str:
    """One row per rank; each ``unit`` of time is a fixed-width cell (kind + microbatch)."""
    unit = unit or _time_unit(tl)
    width = len(str(tl.n_microbatches - 1))
    n_cells = round(tl.makespan / unit)
    lines = [f"{_title(tl)}  (one cell = {unit:g} time unit{'s' if unit != 1 else ''})"]
    for rank, blocks in enumerate(tl.ranks):
        cells = ["." * (1 + width)] * n_cells
        for b in blocks:
            letter = b.kind if _chunk(tl, rank, b.stage) % 2 == 0 else b.kind.lower()
            for c in range(round(b.start / unit), round(b.end / unit)):
                cells[c] = f"{letter}{b.microbatch:0{width}d}"
        lines.append(f"rank {rank:<{len(str(tl.pp - 1))}} |{''.join(cells)}|")
    kinds = {b.kind for bl in tl.ranks for b in bl}
    names = {"F": "forward", "B": "full backward", "I": "input-grad", "W": "weight-grad"}
    legend = ", ".join(f"{k}={names[k]}" for k in _KINDS if k in kinds)
    lines.append(f"legend: {legend}; digits = microbatch; '.' = idle")
    if tl.stages_per_rank == 2:
        lines.append("        UPPERCASE = the rank's first stage, lowercase = its second stage")
    elif tl.stages_per_rank > 2:
        lines.append("        UPPERCASE = the rank's stages 0, 2, ..., lowercase = its stages 1, 3, ...")
    if any(b.overlapped for bl in tl.ranks for b in bl):
        lines.append("        overlapped F+B actions are drawn as their F part then their B part")
    return "\n".join(lines)


_COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (251, 140, 0), "W": (142, 68, 173)}


def _shade(rgb: tuple[int, int, int], chunk: int, v: int) -> tuple[int, int, int]:
    """Later chunks on a rank get lighter versions of the kind colour."""
    t = 0.55 * chunk / max(1, v - 1)
    return tuple(round(c + (255 - c) * t) for c in rgb)  # type: ignore[return-value]


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow < 10.1 or no FreeType: fixed bitmap font
        return ImageFont.load_default()


def _hatch(draw, x0: int, y0: int, x1: int, y1: int, step: int = 8) -> None:
    """Light grey box with 45-degree hatching (the look of idle time)."""
    draw.rectangle([x0, y0, x1, y1], fill=(238, 238, 238))
    h = y1 - y0
    for x in range(x0 - h, x1, step):  # line from (x, y0) down-right to (x + h, y1), clipped
        cut_left, cut_right = max(0, x0 - x), max(0, x + h - x1)
        draw.line([(x + cut_left, y0 + cut_left), (x + h - cut_right, y1 - cut_right)], fill=(205, 205, 205))


def render_png(tl: Timeline, path) -> None:
    """Draw the timeline as a PNG (Pillow only)."""
    from PIL import Image, ImageDraw

    px = max(6.0, min(40.0, 1400.0 / tl.makespan))  # pixels per time unit
    row_h, gap, left, top, right = 30, 8, 70, 58, 20
    plot_w = round(tl.makespan * px)
    legend_y = top + tl.pp * (row_h + gap) + 22
    img = Image.new("RGB", (left + plot_w + right, legend_y + 34), "white")
    draw = ImageDraw.Draw(img)
    font, small = _font(14), _font(12)

    draw.text((left, 8), _title(tl), fill="black", font=font)
    draw.text((left, 30), _stats(tl), fill=(60, 60, 60), font=small)

    for rank, blocks in enumerate(tl.ranks):
        y0 = top + rank * (row_h + gap)
        y1 = y0 + row_h
        # idle background: light grey with diagonal hatching; blocks are drawn on top
        _hatch(draw, left, y0, left + plot_w, y1)
        draw.text((8, y0 + row_h // 2), f"rank {rank}", fill="black", font=font, anchor="lm")
        for b in blocks:
            x0, x1 = left + b.start * px, left + b.end * px
            color = _shade(_COLORS[b.kind], _chunk(tl, rank, b.stage), tl.stages_per_rank)
            draw.rectangle([x0, y0, x1 - 1, y1], fill=color, outline="white")
            if b.overlapped:
                draw.line([(x0, y1 - 2), (x1 - 1, y1 - 2)], fill="black", width=2)
            label = str(b.microbatch)
            if draw.textlength(label, font=small) < x1 - x0 - 2:
                draw.text(((x0 + x1) / 2, (y0 + y1) / 2), label, fill="black", font=small, anchor="mm")

    # time axis
    axis_y = top + tl.pp * (row_h + gap)
    step = max(1, round(60 / px))
    for t in range(0, math.floor(tl.makespan) + 1, step):
        x = left + t * px
        draw.line([(x, axis_y - 4), (x, axis_y)], fill="black")
        draw.text((x, axis_y + 2), str(t), fill="black", font=small, anchor="mt")

    # legend
    names = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}
    kinds = [k for k in _KINDS if any(b.kind == k for bl in tl.ranks for b in bl)]
    x = left
    for k in kinds:
        draw.rectangle([x, legend_y, x + 14, legend_y + 14], fill=_COLORS[k])
        draw.text((x + 18, legend_y + 7), f"{k} {names[k]}", fill="black", font=small, anchor="lm")
        x += 30 + round(draw.textlength(f"{k} {names[k]}", font=small))
    notes = ["number = microbatch", "hatched = idle"]
    if tl.stages_per_rank > 1:
        notes.append("lighter = later stage on the rank")
    if any(b.overlapped for bl in tl.ranks for b in bl):
        notes.append("underlined = overlapped F+B")
    draw.text((x, legend_y + 7), ";  ".join(notes), fill=(60, 60, 60), font=small, anchor="lm")
    img.save(path, format="PNG")
