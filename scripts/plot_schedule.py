"""Print (and optionally draw) the timeline of a pipeline-parallel schedule.

    python scripts/plot_schedule.py --schedule 1F1B --pp 4 --microbatches 8
    python scripts/plot_schedule.py --schedule Interleaved1F1B --pp 4 --microbatches 8 \
        --stages-per-rank 2 --png interleaved.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from titanlike.layout import SCHEDULES, canonical_schedule_name, schedule_facts, schedule_timeline  # noqa: E402
from titanlike.planner.schedule_plot import render_png, render_text  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--schedule", required=True, help="one of: " + ", ".join(SCHEDULES))
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--stages-per-rank", type=int, default=None, help="default: 1 for single-stage schedules, else 2")
    p.add_argument("--f-time", type=float, default=1.0, help="forward time of one stage")
    p.add_argument("--b-time", type=float, default=2.0, help="full backward time of one stage")
    p.add_argument(
        "--w-time",
        type=float,
        default=None,
        help="weight-grad part of the backward (zero-bubble schedules); default b/2",
    )
    p.add_argument("--png", default=None, help="also write a PNG picture here")
    args = p.parse_args(argv)

    try:
        name = canonical_schedule_name(args.schedule)
    except ValueError:
        print(f"unknown schedule {args.schedule!r}; valid: {', '.join(SCHEDULES)}", file=sys.stderr)
        return 2
    v = args.stages_per_rank or schedule_facts(name).default_stages_per_rank
    tl = schedule_timeline(
        name, args.pp, args.microbatches, v, f_time=args.f_time, b_time=args.b_time, w_time=args.w_time
    )
    print(render_text(tl))
    print(f"simulated bubble fraction (idle / (pp * makespan)): {tl.bubble_fraction:.4f}")
    print(f"simulated idle / busy time:                          {tl.bubble_ratio:.4f}")
    print(f"formula (pp-1)/(v*m):                                {tl.formula:.4f}")
    if args.png:
        render_png(tl, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
