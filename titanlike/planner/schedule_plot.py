"""Pictures of pipeline-parallel schedules: the simulated timelines of :mod:`titanlike.layout.timeline` as text
(one row per rank) or a PNG (Pillow). ``scripts/plot_schedule.py`` prints and draws them."""

from __future__ import annotations

import math
from fractions import Fraction

from titanlike.layout.timeline import KINDS, Timeline

__all__ = ["render_png", "render_text"]


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
    legend = ", ".join(f"{k}={names[k]}" for k in KINDS if k in kinds)
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
    kinds = [k for k in KINDS if any(b.kind == k for bl in tl.ranks for b in bl)]
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
