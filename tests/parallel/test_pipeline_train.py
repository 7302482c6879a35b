"""train.py under pipeline parallelism (torchrun, 4 ranks: pp 2 x tp 2 with SP, the V-shaped zero-bubble schedule,
tied embeddings) logs the same training losses, gradient norms and validation losses as one process."""

import json
import subprocess
import sys
from pathlib import Path

from dist_utils import worker_env

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "train.py",
    "--job.config_file",
    "configs/debug_model.toml",
    "--training.steps",
    "3",
    "--metrics.log_freq",
    "1",
    "--validation.freq",
    "3",
    "--validation.steps",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--model.tie_embeddings",
    "true",
    "--training.local_batch_size",
    "16",
]
PP = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.enable_sequence_parallel",
    "true",
    "--parallelism.pipeline_parallel_schedule",
    "ZBVZeroBubble",
    "--parallelism.pipeline_parallel_microbatch_size",
    "4",
)


def _run(out: Path, *args: str, nproc: int = 1) -> list[dict]:
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    env = worker_env()
    r = subprocess.run(
        [*launcher, *COMMON, "--job.dump_folder", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_training_matches_one_process(tmp_path):
    single = _run(tmp_path / "single")
    piped = _run(tmp_path / "pp", *PP, nproc=4)

    def series(rows, key):
        return [(row["step"], row[key]) for row in rows if key in row]

    for key in ("loss", "grad_norm", "val_loss"):
        a, b = series(single, key), series(piped, key)
        assert [s for s, _ in a] == [s for s, _ in b] and a, key
        for (step, x), (_, y) in zip(a, b):
            assert abs(x - y) <= 1e-4 * max(1.0, abs(x)), (key, step, x, y)  # float32, other summation orders
