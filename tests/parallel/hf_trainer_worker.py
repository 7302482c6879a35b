"""``train.py`` of a transformers model (``--model.name hf --model.hf_config <folder>``) on one process, under
tp2 + SP and under pp2, the trainer exactly as under torchrun, for tests/parallel/test_hf_trainer.py.

    python tests/parallel/hf_trainer_worker.py OUT_DIR HF_CONFIG_FOLDER [train.py options ...]

Jobs (each into OUT_DIR/NAME, forked from this process, which imported the trainer once): ``single`` (one
process), ``tp2_sp`` (2 ranks, saving its DCP checkpoint at step 2) and ``pp2`` (2 ranks), then ``resharded``: one
process resuming the tp2 + SP checkpoint of step 2 (DCP resharding of the library's modules). The losses are in
``NAME/metrics.jsonl``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: then importing it starts no thread, and forking is safe

import transformers  # noqa: E402, F401 - imported once, before the forks
from dist_utils import run_trainer_job  # noqa: E402

import titanlike.training.trainer  # noqa: E402, F401
from titanlike.models.transformers_lm import args_from_folder, param_init, sharding_for  # noqa: E402

ARGV = [
    "--model.name",
    "hf",
    "--training.dtype",
    "float64",
    "--training.steps",
    "3",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
JOBS = {
    "single": (1, []),
    "tp2_sp": (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "true", *CKPT],
    ),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "resharded": (1, CKPT),  # resumes tp2_sp's step-2 checkpoint in one process
}


def main() -> int:
    out, folder, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    args = args_from_folder(folder)  # checked, built on meta and translated once, before the forks (cached)
    sharding_for(args), param_init(args)
    for name, (world, more) in JOBS.items():
        if name == "resharded":
            step2 = Path("checkpoint") / "step-2"
            shutil.copytree(out / "tp2_sp" / step2, out / name / step2)
        codes = run_trainer_job(out / name, [*ARGV, "--model.hf_config", folder, *extra, *more], world_size=world)
        if any(codes):
            print(f"job {name}: exit codes {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
