"""Training jobs of forked ranks (``dist_utils.run_trainer_job``, one import of the trainer for all) with the
silent-corruption sentinel on, one after the other, for tests/fault/test_sentinel.py.

    python tests/fault/sentinel_worker.py OUT_DIR NAME=WORLD:FLIP ... -- <train.py options common to all>

Job NAME runs on WORLD ranks into ``OUT_DIR/NAME`` with the common options plus those of ``OUT_DIR/NAME.args``
(one per line). FLIP is ``-`` (a clean run) or ``RANK/STEP/PARAM/BIT``: right after its training step STEP, rank
RANK flips bit BIT of the first element of its local tensor of parameter PARAM (a name as ``named_parameters``
gives it), in place, as a chip or a memory cell that computes or keeps a wrong bit without crashing would. It
writes ``OUT_DIR/NAME/flipped`` (the parameter, the rank, the step, the element before and after). Each job's exit
codes go to ``OUT_DIR/NAME/codes.json``.

    torchrun ... tests/fault/sentinel_worker.py --main <train.py options>

One rank of a torchrun job (a torchft replica group): ``SDC_FLIP`` (``RANK/STEP/PARAM/BIT``, optional) is planted
the same way, writing ``SDC_DUMP/flipped``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer as trainer_module  # noqa: E402


def flip_bit(t, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of element 0 of ``t`` (a local tensor) in place; return its value before and after."""
    import torch

    flat = t.detach().view(-1)
    before = float(flat[0])
    words = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])
    words[0] ^= 1 << bit
    return before, float(flat[0])


def plant(spec: str, dump: Path):
    """The ``setup(rank)`` of the job: on the faulty rank, wrap the trainer's train_step to flip the bit."""
    if spec == "-":
        return None
    rank_s, step_s, param, bit_s = spec.split("/")

    def setup(rank: int) -> None:
        if rank != int(rank_s):
            return
        import torch
        from torch.distributed.tensor import DTensor

        train_step, calls = trainer_module.train_step, []

        def planted(model_parts, *args, **kwargs):
            out = train_step(model_parts, *args, **kwargs)
            calls.append(1)
            if len(calls) == int(step_s):
                p = next(p for m in model_parts for n, p in m.named_parameters() if n == param)
                local = p.to_local() if isinstance(p, DTensor) else p
                with torch.no_grad():
                    before, after = flip_bit(local, int(bit_s))
                (dump / "flipped").write_text(
                    json.dumps({"param": param, "rank": rank, "step": len(calls), "before": before, "after": after})
                )
            return out

        trainer_module.train_step = planted

    return setup


def main() -> int:
    if sys.argv[1] == "--main":
        flip = os.environ.get("SDC_FLIP")
        if flip:
            plant(flip, Path(os.environ["SDC_DUMP"]))(int(os.environ["RANK"]))
        return trainer_module.main(sys.argv[2:])
    split = sys.argv.index("--")
    out, jobs, common = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    for job in jobs:
        name, rest = job.split("=", 1)
        world, spec = rest.split(":", 1)
        dump = out / name
        dump.mkdir(parents=True, exist_ok=True)
        extra_file = out / f"{name}.args"
        extra = extra_file.read_text().split() if extra_file.exists() else []
        codes = run_trainer_job(dump, [*common, *extra], world_size=int(world), setup=plant(spec, dump))
        (dump / "codes.json").write_text(json.dumps(codes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
