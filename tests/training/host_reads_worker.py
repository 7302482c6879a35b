"""The trainer's host reads per step, counted on 2 forked ranks exactly as under torchrun, for
tests/training/test_host_reads.py::test_the_trainer_reads_nothing_on_the_host_between_log_steps.

    python tests/training/host_reads_worker.py OUT_DIR [train.py options ...]

Jobs (each into OUT_DIR/NAME): ``llama_fsdp2`` (llama debugmodel, FSDP over 2 ranks) with a ``.item()`` planted in
the first block's forward at step 6, ``qwen3_moe_ep2`` (expert parallelism 2, the uneven dispatch) and
``qwen3_moe_ep2_padded`` (the padded one). Each runs 7 steps with ``metrics.log_freq 10``: steps 1 and 7 are log
steps. Each rank writes ``reads_rank<r>.json``: for every step, the reads recorded from the start of that step's
``_run_step`` to the start of the next (``str(HostRead)``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer as trainer_module  # noqa: E402 - imported once, before the forks
from titanlike import hang  # noqa: E402
from titanlike.models.llama.model import TransformerBlock  # noqa: E402
from titanlike.training.host_reads import count_host_reads  # noqa: E402

PLANTED_STEP = 6
COMMON = [
    "--training.steps",
    "7",
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "10",
    "--validation.enable",
    "false",
    "--optimizer.implementation",
    "fused",  # the GPU's default: the skip flag goes into the kernel (on a CPU, foreach AdamW reads it once a step)
]
JOBS = {
    "llama_fsdp2": ["--model.name", "llama3", "--model.n_layers", "2"],
    "qwen3_moe_ep2": [
        "--model.name",
        "qwen3_moe",
        "--model.n_layers",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
    ],
}
JOBS["qwen3_moe_ep2_padded"] = [*JOBS["qwen3_moe_ep2"], "--parallelism.expert_dispatch", "padded"]


def plant_a_read() -> None:
    """A stray ``.item()`` in the first block's forward at step PLANTED_STEP (llama only)."""
    forward = TransformerBlock.forward

    def planted_forward(self, x, *args, **kwargs):
        out = forward(self, x, *args, **kwargs)
        if hang.WHERE.step == PLANTED_STEP and self.layer_id == 0:
            out.abs().max().item()  # the planted read
        return out

    TransformerBlock.forward = planted_forward


def counting(dump: Path, plant: bool):
    def setup(rank: int) -> None:
        if plant:
            plant_a_read()
        trainer = trainer_module.Trainer
        train, run_step = trainer.train, trainer._run_step
        marks: list[int] = []
        box = {}

        def counted_train(self):
            with count_host_reads() as reads:
                box["reads"] = reads
                try:
                    return train(self)
                finally:
                    ends = [*marks[1:], len(reads.reads)]
                    steps = [[str(r) for r in reads.reads[a:b]] for a, b in zip(marks, ends)]
                    (dump / f"reads_rank{rank}.json").write_text(json.dumps(steps, indent=0))

        def counted_step(self, data_iter):
            marks.append(len(box["reads"].reads))
            return run_step(self, data_iter)

        trainer.train, trainer._run_step = counted_train, counted_step

    return setup


def main() -> int:
    out, extra = Path(sys.argv[1]), sys.argv[2:]
    for name, argv in JOBS.items():
        dump = out / name
        codes = run_trainer_job(dump, COMMON + argv + extra, world_size=2, setup=counting(dump, name == "llama_fsdp2"))
        if any(codes):
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
