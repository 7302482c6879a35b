"""The [eval] section on a tp2 + sequence-parallel training run (2 forked ranks, as under torchrun; wandb on, in
offline mode), then the same step's checkpoint scored in this one process: writes both, and what the wandb runs
logged, to the JSON named on the command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import run_trainer_job  # noqa: E402

import titanlike.evaluation  # noqa: E402, F401 - lm-eval imported once, before the fork
from titanlike.training.trainer import main as _  # noqa: E402, F401

ARGV = [
    "--model.flavor", "tiny", "--model.tokenizer", "test", "--training.seq_len", "64",
    "--training.local_batch_size", "2", "--training.steps", "4", "--metrics.log_freq", "2",
    "--validation.enable=false", "--checkpoint.enable", "--checkpoint.interval", "4",
    "--eval.enable", "--eval.tasks", "shakespeare_next_line", "--eval.limit", "12", "--eval.freq", "2",
    "--metrics.enable_wandb",
]  # fmt: skip
LAYOUT = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]


def main(out: Path) -> int:
    import wandb_offline

    from titanlike.evaluation import TitanlikeLM, evaluate, task_metrics

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")

    dump = out.parent / "tp2sp"
    codes = run_trainer_job(dump, [*ARGV, *LAYOUT], world_size=2)
    if any(codes):
        for r in range(2):
            print(f"--- rank {r}:\n{(dump / f'rank{r}.log').read_text()[-3000:]}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    lm = TitanlikeLM(checkpoint=str(dump / "checkpoint" / "step-4"), max_length=64)
    single = task_metrics(evaluate(lm, ["shakespeare_next_line"], limit=12))
    log = (dump / "rank0.log").read_text()
    runs = {str(f): wandb_offline.history(f) for f in wandb_offline.run_files(dump)}
    out.write_text(json.dumps({"rows": rows, "single": single, "console": log, "wandb": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
