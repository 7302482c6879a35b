"""``train.py`` of qwen3_moe on one process and on 2 ranks with expert parallelism, the trainer exactly as under
torchrun, for tests/parallel/test_moe_trainer.py.

    python tests/parallel/moe_trainer_worker.py OUT_DIR [train.py options ...]

Jobs (each into OUT_DIR/NAME, forked from this process, which imported the trainer once):

* ``single``: ``python train.py`` of the config (one process);
* ``ep2``: the same config with ``--parallelism.expert_parallel_degree 2`` on 2 ranks (dp_shard 2 = ep 2);

(The planted bugs of the same wiring, the bias update from local loads among them, run in the gate:
tests/parallel/gate.py.)

Every job records, after each step, the expert biases of every MoE block (``ExpertBalancing.end_step`` wrapped,
behaviour unchanged) into ``NAME/biases_rank<r>.pt``; the losses are in ``NAME/metrics.jsonl``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

import torch  # noqa: E402
from dist_utils import run_trainer_job  # noqa: E402

import titanlike.parallel.expert_parallel as epm  # noqa: E402
import titanlike.training.trainer  # noqa: E402, F401 - imported once, before the forks
from titanlike.models.moe import moe_modules  # noqa: E402

ARGV = [
    "--model.name",
    "qwen3_moe",
    "--model.flavor",
    "debugmodel",
    "--model.n_layers",
    "2",
    "--training.dtype",
    "float64",
    "--training.steps",
    "4",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]


def recording_biases(dump: Path):
    original = epm.ExpertBalancing.end_step

    def end_step(self, update=True):
        out = original(self, update)
        rank = int(os.environ.get("RANK", "0"))
        path = dump / f"biases_rank{rank}.pt"
        seen = torch.load(path) if path.exists() else []
        blocks = [m for part in self.model_parts for m in moe_modules(part)]
        seen.append(torch.stack([m.expert_bias.detach().cpu().clone() for m in blocks]))
        torch.save(seen, path)
        return out

    epm.ExpertBalancing.end_step = end_step
    return original


def main() -> int:
    out, extra = Path(sys.argv[1]), sys.argv[2:]
    for name, (world, argv) in {"single": (1, ARGV + extra), "ep2": (2, ARGV + extra + EP2)}.items():
        dump = out / name
        dump.mkdir(parents=True, exist_ok=True)
        original = recording_biases(dump)
        try:
            codes = run_trainer_job(dump, argv, world_size=world)
        finally:
            epm.ExpertBalancing.end_step = original
        if any(codes):
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
