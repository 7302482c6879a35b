"""``python -m titanlike.localize``: see :mod:`titanlike.localize`."""

from __future__ import annotations

import argparse
import sys

USAGE = """python -m titanlike.localize --nproc N (--module FILE.py | TRAIN.PY FLAGS ...) [--steps 2] [--tol 1e-10]

Runs a layout on N gloo ranks and the same model on one device, float64, and names the first module, phase
(forward / backward / gradient / update), step, microbatch and rank where they differ. --module FILE.py: a file
defining build(), parallelize(model, mesh), batch(), MESH = {"tp": 2} and optionally loss(output, labels);
otherwise every other flag is a train.py flag (the trainer's model and layout). Exit 0: no divergence; 1: a
divergence; 2: bad input."""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m titanlike.localize", usage=USAGE, add_help=True)
    ap.add_argument("--nproc", type=int, default=1, help="gloo ranks to run the layout on")
    ap.add_argument("--module", default=None, help="a user's file: build(), parallelize(model, mesh), batch(), MESH")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps compared")
    ap.add_argument("--tol", type=float, default=1e-10, help="largest |difference| taken as equal (float64)")
    ap.add_argument("--lr", type=float, default=1e-2, help="--module: the AdamW learning rate of both runs")
    ap.add_argument("--timeout", type=float, default=60.0, help="gloo timeout of a collective, seconds")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    a, rest = parse(sys.argv[1:] if argv is None else argv)
    problems = []
    if a.nproc < 1:
        problems.append(f"--nproc must be at least 1, got {a.nproc}")
    if a.steps < 1:
        problems.append(f"--steps must be at least 1, got {a.steps}")
    if not a.tol >= 0:
        problems.append(f"--tol must be >= 0, got {a.tol}")
    if a.module is not None and rest:
        problems.append(f"--module takes no train.py flags, got {' '.join(rest)}")
    from titanlike.localize.launch import run_ranks

    if a.module is not None:
        from titanlike.localize.user import run_user_module, user_problems

        problems += user_problems(a.module, a.nproc) if not problems else []
        if problems:
            print(f"error: {'; '.join(problems)}", file=sys.stderr)
            return 2
        code, text = run_ranks(run_user_module, a.nproc, a.module, a.steps, a.tol, a.lr, timeout_s=a.timeout)
    else:
        from titanlike.localize.trainer import run_trainer, trainer_problems

        problems += trainer_problems(rest, a.nproc) if not problems else []
        if problems:
            print(f"error: {'; '.join(problems)}", file=sys.stderr)
            return 2
        code, text = run_ranks(run_trainer, a.nproc, rest, a.steps, a.tol, timeout_s=a.timeout)
    print(text, file=sys.stderr if code == 3 else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
