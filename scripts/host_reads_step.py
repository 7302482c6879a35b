"""The device-to-host reads of every training step, counted in a real one-process run of train.py.

    python scripts/host_reads_step.py --job.config_file configs/debug_model.toml          # any train.py options
    python scripts/host_reads_step.py --job.config_file configs/llama3_1b.toml --compile.enable true --json r.json

A read of a device value on the host drains the GPU's queue and rules out capturing the step as a CUDA graph
(``titanlike.training.host_reads``). This runs ``titanlike.training.trainer.main`` in this process (no torchrun: one
rank) with the steps' reads recorded, then prints, per step, the number of reads and where each came from, and the
steps' wall seconds. Steps that do not log, validate or save should read nothing: the number this prints for them is
what the GPU sees. Defaults: 7 steps, logging every 10 (steps 1 and 7 log), validation off, fused AdamW; options
given here override them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULTS = [
    "--training.steps",
    "7",
    "--metrics.log_freq",
    "10",
    "--validation.enable",
    "false",
    "--optimizer.implementation",
    "fused",
]


def main(argv: list[str]) -> int:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2 :]

    import titanlike.training.trainer as trainer_module
    from titanlike.training.host_reads import count_host_reads

    trainer = trainer_module.Trainer
    train, run_step = trainer.train, trainer._run_step
    marks: list[tuple[int, float]] = []
    box: dict = {}

    def counted_train(self):
        with count_host_reads() as reads:
            box["reads"] = reads
            try:
                return train(self)
            finally:
                box["end"] = (len(reads.reads), time.perf_counter())

    def counted_step(self, data_iter):
        marks.append((len(box["reads"].reads), time.perf_counter()))
        return run_step(self, data_iter)

    trainer.train, trainer._run_step = counted_train, counted_step
    code = trainer_module.main([*DEFAULTS, *argv])
    if code or "reads" not in box:
        return code or 1
    reads = box["reads"].reads
    ends = [*marks[1:], box["end"]]
    steps = []
    for n, ((a, t0), (b, t1)) in enumerate(zip(marks, ends, strict=True), start=1):
        steps.append({"step": n, "reads": [str(r) for r in reads[a:b]], "seconds": round(t1 - t0, 4)})
    print(f"{'step':>4} {'reads':>5} {'seconds':>8}  first read")
    for s in steps:
        print(f"{s['step']:>4} {len(s['reads']):>5} {s['seconds']:>8.3f}  {s['reads'][0] if s['reads'] else ''}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"argv": argv, "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
