"""Every rank's divergent points gathered, the first one named, the evidence read, the report written.

The first point is the earliest of every rank's (step, phase, micro-batch, the point's place in the one-device run's
order); of the ranks that diverge there, the largest difference is reported. Its tensors on every rank then decide
the hint: the local tensors of a mesh dim's ranks summing to the reference (a partial sum never reduced over that
dim), a tensor that is a fixed multiple of the reference (a gradient averaged instead of summed: 1/n; counted n
times: n), a Partial placement inside the module turned local, a gradient left with a placement other than the
parameter's, a parameter no data-parallel reduction covers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from titanlike.localize.trace import Point, Tracer

__all__ = ["Outcome", "gather_outcome"]

TABLE = 8  # divergent points listed after the first


@dataclasses.dataclass
class Outcome:
    code: int  # 0: no divergence, 1: divergence
    text: str
    first: dict | None = None  # the first point (its fields), for tests
    hint: str = ""
    table: list[dict] = dataclasses.field(default_factory=list)


def _comms(c: dict[str, int]) -> str:
    if not c:
        return "0 collectives"
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items()))


def _by_key(points: list[Point]) -> list[Point]:
    """One point per key (the largest difference over the ranks), in order."""
    best: dict[tuple, Point] = {}
    for p in points:
        k = p.key()
        if k not in best or _d(p.diff) > _d(best[k].diff):
            best[k] = p
    return [best[k] for k in sorted(best)]


def _d(x: float) -> float:
    return math.inf if x != x else x


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(b.abs().max().item(), 1e-30)
    return a.shape == b.shape and (a - b).abs().max().item() <= 1e-8 * scale


def _sum_hint(first: Point, kept: list, coords: list[dict], sizes: dict[str, int]) -> str:
    """A mesh dim whose ranks' local tensors at ``first`` sum to the reference."""
    for dim, size in sizes.items():
        if size < 2:
            continue
        groups: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            groups.setdefault(tuple((k, v) for k, v in c.items() if k != dim), []).append(r)
        ok = True
        for ranks in groups.values():
            have = [kept[r] for r in ranks if kept[r] is not None]
            if len(have) != len(ranks) or any(h[0].shape != have[0][1].shape for h in have):
                ok = False
                break
            total = sum(h[0] for h in have)
            if not _close(total, have[0][1]) or _close(have[0][0], have[0][1]):
                ok = False
                break
        if ok:
            what = "outputs" if first.phase == "forward" else "gradients"
            where = f" ({_comms(first.comms)} there)" if first.phase in ("forward", "backward") else ""
            return (
                f"the {size} {dim} ranks' {what} sum to the reference: a partial sum never reduced over {dim} "
                f"in {first.fqn}{where}"
            )
    return ""


def _ratio_hint(first: Point, kept: list, sizes: dict[str, int], micro: int) -> str:
    """The tensor a fixed multiple c of the reference on every rank that has it."""
    cs = []
    for k in kept:
        if k is None:
            continue
        local, expected = k
        if local.shape != expected.shape or not expected.abs().max().item():
            return ""
        c = (local * expected).sum().item() / (expected * expected).sum().item()
        if not _close(local, c * expected):
            return ""
        cs.append(c)
    if not cs or max(cs) - min(cs) > 1e-6 * abs(cs[0]) or abs(cs[0] - 1) < 1e-6:
        return ""
    c = cs[0]
    if not 1e-3 < abs(c) < 1e3:
        return ""
    what = "gradient" if first.phase == "gradient" else first.phase + " tensor"
    text = f"{first.fqn}'s {what} is {c:.4g} x the reference"
    counts = {n for n in _products({**sizes, "microbatches": micro}) if n > 1}
    for n in sorted(counts):
        if abs(c - 1 / n) < 1e-6:
            return text + f": divided by {n} where a sum was due (a mean over {n} ranks or microbatches?)"
        if abs(c - n) < 1e-6:
            return text + f": counted {n} times where once was due (once per rank or microbatch?)"
    return text


def _products(sizes: dict[str, int]) -> set[int]:
    out = {1}
    for s in sizes.values():
        out |= {o * s for o in out}
    return out


def hint_for(
    first: Point, kept: list, coords: list[dict], sizes: dict[str, int], uncovered: list[str], micro: int = 1
) -> str:
    if first.note.startswith("raised"):
        return first.hint or f"the layout's step raised inside {first.fqn} (its inputs: {first.placement})"
    name = f"{first.fqn}.{first.what}"
    if first.phase in ("gradient", "update") and name in uncovered:
        return f"no data-parallel reduction covers {name}: each data-parallel rank steps its own copy"
    if first.note:
        return first.note
    if first.fqn == "(gradient norm)":
        return (
            "every gradient agrees but the global gradient norm does not: the norm's reduction over the mesh dims "
            "and pipeline stages (a shard or a tied copy counted twice, or not at all)"
        )
    if "Partial" in first.inner and "Partial" not in first.placement:
        return (
            f"{first.fqn}'s output placement {first.inner} was never reduced "
            f"({first.comms.get('all_reduce', 0)} all-reduce in this module) before it became a local tensor"
        )
    return _sum_hint(first, kept, coords, sizes) or _ratio_hint(first, kept, sizes, micro)


def _line(p: Point) -> str:
    inner = f" (inside the module: {p.inner})" if p.inner and p.inner != p.placement else ""
    where = f"step {p.step}, microbatch {p.micro}, rank {p.rank}"
    if p.note.startswith("raised"):
        inner = f", {p.inner}" if p.inner else ""
        return f"{p.fqn} {p.phase}: {where}: {p.note} (input {p.placement}{inner})"
    text = f"{p.fqn} {p.phase}: {where}: max |diff| {p.diff:.1e} ({p.what})"
    if p.placement:
        text += f"; placement {p.placement}{inner}"
    if p.phase in ("forward", "backward"):
        text += f"; {_comms(p.comms)} in this module"
    return text


def gather_outcome(
    tracer: Tracer,
    steps: int,
    tol: float,
    coords: dict[str, int],
    sizes: dict[str, int],
    uncovered: list[str] = (),
    micro: int = 1,
) -> Outcome:
    """Collect every rank's points (two ``all_gather_object``: the points, then the first point's tensors); the same
    :class:`Outcome` on every rank. ``coords`` / ``sizes``: this rank's mesh coordinates and the mesh dims' sizes;
    ``uncovered``: parameters no data-parallel reduction covers; ``micro``: micro-batches per step on a rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = ([dataclasses.asdict(p) for p in tracer.points], tracer.compared, sorted(tracer.not_compared), coords)
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    points = [Point(**d) for e in everyone for d in e[0]]
    compared = sum(e[1] for e in everyone)
    skipped = sorted({tuple(x) for e in everyone for x in e[2]})
    if not points:
        note = f" ({compared} points compared"
        note += f"; not comparable here: {len(skipped)} module points" if skipped else ""
        return Outcome(0, f"no divergence above {tol:g} in {steps} steps{note})")
    ordered = _by_key(points)
    first = ordered[0]
    kept_mine = tracer.kept.get(first.key())
    kept = [None] * world
    if world > 1:
        dist.all_gather_object(kept, kept_mine)
    else:
        kept = [kept_mine]
    all_coords = [e[3] for e in everyone]
    hint = hint_for(first, kept, all_coords, sizes, list(uncovered), micro)
    lines = [f"divergence: {_line(first)}"]
    if hint:
        lines.append(f"hint: {hint}")
    rest = ordered[1 : 1 + TABLE]
    if rest:
        lines.append("next divergent points:")
        lines.append(f"  {'step':>4} {'phase':9} {'mb':>2} {'rank':>4} {'max |diff|':>10}  module (tensor; placement)")
        for p in rest:
            if p.note:
                lines.append(f"  {p.step:>4} {p.phase:9} {p.micro:>2} {p.rank:>4} {'':>10}  {p.fqn} ({p.note[:100]})")
                continue
            lines.append(
                f"  {p.step:>4} {p.phase:9} {p.micro:>2} {p.rank:>4} {p.diff:>10.1e}  {p.fqn} ({p.what}; {p.placement})"
            )
    lines.append(f"{len(ordered)} divergent points, {compared} points compared over {world} ranks")
    return Outcome(1, "\n".join(lines), dataclasses.asdict(first), hint, [dataclasses.asdict(p) for p in rest])
