"""Replay a training step: re-run step N from a checkpoint before it and compare the state it reaches with the run's
own checkpoint of step N, bitwise (every weight, optimizer moment, RNG state and counter the checkpoint holds).

    python scripts/replay_step.py --checkpoint outputs/debug/checkpoint --step 6 -- <the run's train.py options>
    torchrun --nproc_per_node 4 scripts/replay_step.py --checkpoint ... --step 6 -- <options>   # the run's layout

The replay starts from the newest committed checkpoint before step N (``--from`` picks another) and trains to N in
``replay-step-N`` beside the checkpoint folder (removed after; the run's folder is only read), with the run's own
options; on another number of processes than the run's, with the run's global batch (accumulated) and, on one
process, every parallel degree 1 (the same model, data, seed and global batch). It prints one line: ``bitwise
equal`` (exit 0), or the tensors that differ, largest difference first, and the loss of step N in both (exit 1).
A healthy machine replays a step on the same layout
bitwise (CPU; on a GPU with ``training.deterministic``); a step whose saved state differs was computed or stored
wrong (a flipped bit, a faulty chip), or the replay ran on another layout or machine, where reductions add in
another order (differences of a few ulps, everywhere): then ``python -m titanlike.localize`` with the same options
names the first module and phase where the layout parts from one device. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.errors import ConfigError  # noqa: E402


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="the run's checkpoint folder (holding step-N folders)")
    ap.add_argument("--step", type=int, required=True, help="the step to replay (its checkpoint is the reference)")
    ap.add_argument(
        "--from",
        dest="start",
        type=int,
        default=None,
        help="the checkpoint to start from (default: the newest before --step)",
    )
    ap.add_argument("--keep", default="", help="keep the replay's folder here (default: a scratch folder, removed)")
    return ap.parse_args(argv[:split]), argv[split + 1 :]


def read_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint folder holds (any layout), by its key, read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanlike.checkpoint import load_verified, read_dcp_metadata
    from titanlike.checkpoint.files import quiet_dcp
    from titanlike.checkpoint.parts import verified_records

    md = read_dcp_metadata(step_dir)
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    try:
        quiet_dcp(load_verified, sd, step_dir, verified_records(step_dir), no_dist=True)
    except dcp.CheckpointException as e:
        raise ConfigError(f"checkpoint '{step_dir}' cannot be read: {str(e).strip().splitlines()[-1]}") from None
    return sd


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def compare(reference: dict[str, torch.Tensor], replay: dict[str, torch.Tensor]) -> list[tuple[str, int, float]]:
    """(key, elements that differ, largest absolute difference) of every tensor not bitwise equal, largest first."""
    out = []
    for k in sorted(set(reference) | set(replay)):
        if k.startswith("rng.rank") and not (k in reference and k in replay):
            continue  # another layout: one RNG state per rank of each
        a, b = reference.get(k), replay.get(k)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out.append((k, -1, float("inf")))
            continue
        if torch.equal(_bits(a), _bits(b)):  # bitwise: -0.0 against 0.0, or two NaNs, count as they are
            continue
        ne = a != b
        diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() or a.is_complex() else 1.0
        out.append((k, int(ne.sum()) if ne.any() else int(a.numel()), diff))
    return sorted(out, key=lambda x: -x[2])


def loss_of(metrics: Path, step: int) -> float | None:
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == step and "loss" in row:
            found = row["loss"]
    return locals().get("found")


def main(argv: list[str] | None = None) -> int:
    opts, train_argv = parse(sys.argv[1:] if argv is None else argv)
    from titanlike.checkpoint import committed_checkpoints, read_meta
    from titanlike.config import load_config
    from titanlike.training.trainer import Trainer, _print_error

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    folder = Path(opts.checkpoint)
    steps = committed_checkpoints(folder)
    try:
        if opts.step not in steps:
            raise ConfigError(
                f"--step {opts.step}: {folder} holds no committed checkpoint of that step (it holds "
                f"{sorted(steps) or 'none'}); replay a step the run saved"
            )
        before = [s for s in steps if s < opts.step]
        start = opts.start if opts.start is not None else (before[-1] if before else None)
        if start is None or start not in before:
            raise ConfigError(
                f"--from {start}: no committed checkpoint before step {opts.step} to start from (the run saved "
                f"{sorted(steps)}); save more often (checkpoint.interval) around the step to replay"
            )
        # next to the run's folder (every rank of a torchrun replay finds it; the run's own files are only read)
        scratch = Path(opts.keep) if opts.keep else folder.resolve().parent / f"replay-step-{opts.step}"
        run_world = int(read_meta(steps[start]).get("world_size", world))
        layout = []
        if run_world != world:  # another layout: the run's global batch (accumulated), one process's degrees
            from titanlike.layout import batch_split

            t = load_config(train_argv, world_size=run_world).training
            dp = int(read_meta(steps[start]).get("dp_degree", 1))
            layout = [
                "--training.global_batch_size",
                str(batch_split(t.global_batch_size, t.local_batch_size, dp).global_batch),
            ]
            if world == 1:
                layout += [
                    f"--parallelism.{k}"
                    for k in (
                        "data_parallel_replicate_degree 1",
                        "data_parallel_shard_degree -1",
                        "tensor_parallel_degree 1",
                        "context_parallel_degree 1",
                        "pipeline_parallel_degree 1",
                        "expert_parallel_degree 1",
                        "enable_sequence_parallel false",
                    )
                ]
                layout = [w for item in layout for w in item.split(" ")]
        if rank == 0:
            (scratch / "checkpoint").mkdir(parents=True, exist_ok=True)
            target = scratch / "checkpoint" / f"step-{start}"
            if not target.exists():
                shutil.copytree(steps[start], target)
        if world > 1:  # every rank starts once rank 0 copied the checkpoint (the folder is on a shared file system)
            import time

            while not (scratch / "checkpoint" / f"step-{start}" / ".metadata").exists():
                time.sleep(0.1)
        cfg = load_config(
            [
                *train_argv,
                *layout,
                "--training.steps",
                str(opts.step),
                "--checkpoint.enable",
                "--checkpoint.folder",
                str(scratch / "checkpoint"),
                "--checkpoint.interval",
                str(opts.step),
                "--checkpoint.load_step",
                str(start),
                "--checkpoint.keep_latest_k",
                "0",
                "--checkpoint.last_save_model_only",
                "false",
                "--checkpoint.export_safetensors",
                "false",
                "--job.dump_folder",
                str(scratch),
            ],
            world_size=world,
        )
        trainer = Trainer(cfg)
    except ConfigError as e:
        _print_error(e)
        return 2
    try:
        trainer.train()
    finally:
        distributed = trainer.distributed
        trainer.close()
    code = 0
    if rank == 0:
        reference, replay = read_state(steps[opts.step]), read_state(scratch / "checkpoint" / f"step-{opts.step}")
        differs = compare(reference, replay)
        run_loss = loss_of(folder.parent / "metrics.jsonl", opts.step)
        new_loss = loss_of(scratch / "metrics.jsonl", opts.step)
        losses = f"loss of step {opts.step}: run {run_loss!r}, replay {new_loss!r}"
        where = f"step {opts.step} replayed from step {start} on {world} process(es)"
        if not differs:
            print(f"{where}: bitwise equal ({len(reference)} tensors: weights, optimizer state, RNG; {losses})")
        else:
            code = 1
            shown = "; ".join(
                f"'{k}' ({'missing or reshaped' if n < 0 else f'{n} element(s), largest difference {d:.3g}'})"
                for k, n, d in differs[:5]
            )
            more = f" and {len(differs) - 5} more" if len(differs) > 5 else ""
            print(
                f"{where}: {len(differs)} of {len(reference)} tensors differ from the run's checkpoint: {shown}{more}; "
                f"{losses}. Only a few tensors, the loss equal: the saved state was corrupted after the step (a "
                f"flipped bit in memory or on disk); many tensors by a few ulps: another layout or machine (python -m "
                f"titanlike.localize with the same options localises a layout)"
            )
        if not opts.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    if distributed:
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
