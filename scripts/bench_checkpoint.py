"""Measure checkpoint save / async save / load / HF export times of the real Trainer in one process.

    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench                  # debugmodel and a 115M model
    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench --flavor 1B --tokenizer cl100k

For each flavor: build the Trainer (checkpointing on, keep_latest_k 1), then time ``save`` (sync, model + AdamW +
train state) with and without ``checkpoint.checksum`` (alternating, so that both see the same machine load; the
ratio is printed), ``save`` with ``async_mode=async`` (the time training is blocked, and until the commit), a resume
(``load`` in a fresh Trainer), the checksum verification a resume runs first, and the Hugging Face export. Loads
read files the save has just written, so they come from the page cache: a cold read from disk adds size / disk
bandwidth.

Validation (titanlike/restricted_unpickle.py): a resume reads ``.metadata`` twice on a rank (the up-front check and
DCP's own read), each time with the restricted unpickler and the field checks; that is the validation, printed as a
share of the resume. The byte entries are read with ``torch.load(weights_only=True)`` instead of
``weights_only=False``. Both are timed against the stock reads they replace (``pickle.load``, ``weights_only=False``)
on the same bytes, interleaved, and the difference is printed as a share of the resume too. These ratios use the
process's CPU time (``time.process_time``; the resume is single-threaded), which other work on a shared machine does
not inflate the way it inflates wall-clock time.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike import restricted_unpickle  # noqa: E402
from titanlike.checkpoint import export_hf, verify_checksums  # noqa: E402
from titanlike.config import load_config  # noqa: E402
from titanlike.data import asset_path  # noqa: E402
from titanlike.training.trainer import Trainer  # noqa: E402


def _trainer(out: Path, flavor: str, tokenizer: str, mode: str) -> Trainer:
    argv = [
        "--model.flavor",
        flavor,
        "--model.tokenizer",
        tokenizer,
        "--training.steps",
        "1000",
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        "64",
        "--data.path",
        str(asset_path("corpus", "tinyshakespeare.txt")),
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(out),
        "--checkpoint.enable",
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.async_mode",
        mode,
    ]
    return Trainer(load_config(argv, world_size=1))


def _quiet(fn, *args):
    """Run fn with its stdout (the checkpoint log lines) silenced."""
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            return fn(*args)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _median_cpu_s(fns, repeat: int) -> list[float]:
    """Median CPU seconds of each function, run in turn (interleaved, so a change in machine load hits all alike)."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, t in zip(fns, times):
            t0 = time.process_time()
            fn()
            t.append(time.process_time() - t0)
    return [statistics.median(t) for t in times]


def bench_validation(step_dir: Path, repeat: int) -> dict:
    """Seconds per resume in the restricted paths, and in the stock ones they replace, on the same files."""
    raw = (step_dir / ".metadata").read_bytes()
    md = restricted_unpickle.unpickle_metadata(raw)
    blobs = []
    for index, info in md.storage_data.items():
        if type(md.state_dict_metadata[index.fqn]).__name__ == "BytesStorageMetadata":
            with open(step_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blobs.append(f.read(info.length))

    def load_bytes(weights_only: bool):
        for b in blobs:
            torch.load(io.BytesIO(b), weights_only=weights_only)

    n = 5 * repeat
    md_s, md_stock_s = _median_cpu_s([lambda: restricted_unpickle.unpickle_metadata(raw), lambda: pickle.loads(raw)], n)
    bytes_s, bytes_stock_s = _median_cpu_s([lambda: load_bytes(True), lambda: load_bytes(False)], n)
    return {
        "metadata_kib": len(raw) / 2**10,
        "byte_entries": len(blobs),
        "metadata_s": 2 * md_s,
        "metadata_stock_s": 2 * md_stock_s,
        "bytes_s": bytes_s,
        "bytes_stock_s": bytes_stock_s,
    }


def bench(out: Path, flavor: str, tokenizer: str, repeat: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    trainer = _quiet(_trainer, out, flavor, tokenizer, "disabled")
    ckpt = trainer.checkpointer
    sync, plain = [], []
    for i in range(repeat):
        for checksum, times in ((False, plain), (True, sync)):
            ckpt.cfg.checksum = checksum
            trainer.step = 2 * i + 1 + checksum
            t0 = time.perf_counter()
            _quiet(ckpt.save, trainer.step)
            times.append(time.perf_counter() - t0)
    ckpt.cfg.checksum = True
    step_dir = out / "checkpoint" / f"step-{2 * repeat}"  # the newest, saved with checksums
    size = sum(f.stat().st_size for f in step_dir.iterdir())
    verify = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert verify_checksums(step_dir) is None
        verify.append(time.perf_counter() - t0)

    blocked, total = [], []
    ckpt.cfg.async_mode = "async"
    for i in range(repeat):
        trainer.step = 2 * repeat + i + 1
        t0 = time.perf_counter()
        _quiet(ckpt.save, trainer.step)
        blocked.append(time.perf_counter() - t0)
        _quiet(ckpt._wait)
        total.append(time.perf_counter() - t0)

    loads, loads_cpu = [], []
    for _ in range(repeat):
        fresh = _quiet(_trainer, out, flavor, tokenizer, "disabled")
        t0, c0 = time.perf_counter(), time.process_time()
        _quiet(fresh.checkpointer.load)
        loads.append(time.perf_counter() - t0)
        loads_cpu.append(time.process_time() - c0)
        assert fresh.step == 3 * repeat

    validation = bench_validation(out / "checkpoint" / f"step-{3 * repeat}", repeat)
    t0 = time.perf_counter()
    export_hf(out / "checkpoint" / f"step-{3 * repeat}", out / "hf")
    export = time.perf_counter() - t0
    return {
        "flavor": flavor,
        "params": trainer.num_params,
        "size_mib": size / 2**20,
        "save_s": statistics.median(sync),
        "save_plain_s": statistics.median(plain),
        "verify_s": statistics.median(verify),
        "async_blocked_s": statistics.median(blocked),
        "async_total_s": statistics.median(total),
        "load_s": statistics.median(loads),
        "export_hf_s": export,
        "load_cpu_s": statistics.median(loads_cpu),
        **validation,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="scratch folder (deleted and rewritten)")
    parser.add_argument("--flavor", action="append", help="model flavors (default: debugmodel and gpt2_small)")
    parser.add_argument("--tokenizer", default="test", help="tokenizer (sets the vocabulary; default: test, 2k)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (the median is reported)")
    args = parser.parse_args()
    flavors = args.flavor or ["debugmodel", "gpt2_small"]  # gpt2_small's shape with the 2k vocabulary: 115M
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(
        "| model | parameters | checkpoint | save (sync) | save, no checksum | checksum cost | "
        "async: training blocked | async: until committed | load (resume) | verify checksums | HF export |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for flavor in flavors:
        r = bench(Path(args.out) / flavor, flavor, args.tokenizer, args.repeat)
        print(
            f"| {flavor} | {r['params'] / 1e6:.1f}M | {r['size_mib']:.0f} MiB | {r['save_s']:.2f} s | "
            f"{r['save_plain_s']:.2f} s | {r['save_s'] / r['save_plain_s']:.3f}x | "
            f"{r['async_blocked_s']:.2f} s | {r['async_total_s']:.2f} s | {r['load_s']:.2f} s | "
            f"{r['verify_s']:.2f} s | {r['export_hf_s']:.2f} s |",
            flush=True,
        )
        results.append(r)
    print(
        "\nCPU time of this process (other processes on the machine do not inflate it):\n"
        "| model | .metadata | byte entries | resume | metadata validation x 2 (stock pickle.load) | byte "
        "entries, weights_only (stock) | validation / resume | added vs stock DCP / resume |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        extra = r["metadata_s"] - r["metadata_stock_s"] + r["bytes_s"] - r["bytes_stock_s"]
        print(
            f"| {r['flavor']} | {r['metadata_kib']:.0f} KiB | {r['byte_entries']} | {r['load_cpu_s']:.2f} s | "
            f"{r['metadata_s'] * 1e3:.1f} ms ({r['metadata_stock_s'] * 1e3:.1f} ms) | {r['bytes_s'] * 1e3:.1f} ms "
            f"({r['bytes_stock_s'] * 1e3:.1f} ms) | {r['metadata_s'] / r['load_cpu_s']:.2%} | "
            f"{extra / r['load_cpu_s']:.2%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
