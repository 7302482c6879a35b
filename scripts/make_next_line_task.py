"""Build the shipped lm-eval task ``shakespeare_next_line`` from the shipped corpus (deterministic: same file every
run; tests/evaluation checks the shipped one is this script's output).

    python scripts/make_next_line_task.py            # writes titanlike/assets/tasks/shakespeare_next_line/test.jsonl

Each example: three consecutive lines of a speech from the last tenth of tinyshakespeare.txt (the part a training
run holds out for validation is its tail), the line that follows them, and three other lines of that tenth as
distractors, in a seeded random order; ``label`` is the index of the true line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.data import asset_path  # noqa: E402

OUT = asset_path("tasks", "shakespeare_next_line", "test.jsonl")


def build(n: int = 100, seed: int = 0) -> list[dict]:
    lines = asset_path("corpus", "tinyshakespeare.txt").read_text(encoding="utf-8").splitlines()
    tail = lines[int(len(lines) * 0.9) :]
    rng = random.Random(seed)

    # windows of 4 consecutive non-empty lines that are not a speaker's name ("ROMEO:")
    def spoken(s: str) -> bool:
        return bool(s.strip()) and not s.rstrip().endswith(":")

    starts = [i for i in range(len(tail) - 3) if all(spoken(s) for s in tail[i : i + 4])]
    pool = sorted({s for s in tail if spoken(s)})
    out = []
    for i in sorted(rng.sample(starts, n)):
        context, true = tail[i : i + 3], tail[i + 3]
        choices = [true, *rng.sample([s for s in pool if s != true and s not in context], 3)]
        rng.shuffle(choices)
        out.append({"context": "\n".join(context), "choices": choices, "label": choices.index(true)})
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    write(Path(a.out), build())
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
