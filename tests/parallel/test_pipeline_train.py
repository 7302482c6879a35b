"""train.py under pipeline parallelism (4 ranks as torchrun starts them: pp 2 x tp 2 with SP, the V-shaped zero-bubble
schedule, tied embeddings) logs the same training losses, gradient norms and validation losses as one process. Both
runs share one worker (tests/parallel/pipeline_train_worker.py)."""

import json
from pathlib import Path

from dist_utils import run_script

HERE = Path(__file__).resolve().parent
COMMON = [
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


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_training_matches_one_process(tmp_path):
    # one worker: the 4 ranks forked as torchrun starts them, then the single process (one import of the trainer)
    r = run_script(HERE / "pipeline_train_worker.py", str(tmp_path), "4", "--", *COMMON, "--", *PP)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    # the start-up line with the split (rank 0)
    split = "[tok_embeddings, layers.0] [layers.1] [layers.2] [layers.3, norm, output]"
    log = (tmp_path / "pp" / "rank0.log").read_text()
    assert "pipeline: ZBVZeroBubble, 4 stages over pp 2 ranks" in log, log[:3000]
    assert f"per pass; blocks per stage 1 1 1 1: {split}" in log, log[:3000]
    single, piped = _metrics(tmp_path / "single"), _metrics(tmp_path / "pp")

    def series(rows, key):
        return [(row["step"], row[key]) for row in rows if key in row]

    for key in ("loss", "grad_norm", "val_loss"):
        a, b = series(single, key), series(piped, key)
        assert [s for s, _ in a] == [s for s, _ in b] and a, key
        for (step, x), (_, y) in zip(a, b):
            assert abs(x - y) <= 1e-4 * max(1.0, abs(x)), (key, step, x, y)  # float32, other summation orders
