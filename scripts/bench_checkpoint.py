"""Measure checkpoint save / async save / load / HF export times of the real Trainer in one process.

    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench                  # debugmodel and a 115M model
    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench --flavor 1B --tokenizer cl100k

For each flavor: build the Trainer (checkpointing on, keep_latest_k 1), then time ``save`` (sync, model + AdamW +
train state) with and without ``checkpoint.checksum`` (alternating, so that both see the same machine load; the
cost is printed), ``save`` with ``async_mode=async`` (the time training is blocked, and until the commit), a resume
(``load`` in a fresh Trainer) with and without ``checkpoint.checksum`` (alternating too: the checksums are verified
while the entries are read), the finite check a resume runs on the loaded state, a full scan with
``verify_checksums`` (the tool, not part of a resume), and the Hugging Face export. Loads read files the save has
just written, so they come from the page cache: a cold read from disk adds size / disk bandwidth.

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


class _ChecksumClock:
    """What checkpoint.checksum adds, measured exactly instead of as the noisy difference of two whole saves: the CPU
    seconds spent in titanlike.checkpoint.checksums (hashing, records, checksums.json, the file checks; per thread,
    the hashing thread included), and the wall seconds the saving or loading thread itself spends there (its own
    hashing and waiting for the hashing thread at the end): what the save or the resume is held up by."""

    NAMES = ("tensor_digest", "crc32c_hex", "file_digest", "merge_checksums", "read_checksums", "check_files")

    def __init__(self):
        import threading

        from titanlike.checkpoint import checksums

        self.cpu, self.exposed, self._depth = 0.0, 0.0, threading.local()
        for name in self.NAMES:
            setattr(checksums, name, self._wrap(getattr(checksums, name)))
        checksums.write_json = self._wrap(checksums.write_json)
        checksums._Hasher.results = self._wrap(checksums._Hasher.results)
        self._main = threading.main_thread()

    def _wrap(self, fn):
        import threading

        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if not depth:
                    self.cpu += time.thread_time() - c0
                    if threading.current_thread() is self._main:
                        self.exposed += time.perf_counter() - t0

        return timed

    def measure(self, fn) -> tuple[float, float]:
        cpu, exposed = self.cpu, self.exposed
        fn()
        return self.cpu - cpu, self.exposed - exposed


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    _quiet(fn)
    return time.perf_counter() - t0, time.process_time() - c0


def bench(out: Path, flavor: str, tokenizer: str, repeat: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    trainer = _quiet(_trainer, out, flavor, tokenizer, "disabled")
    ckpt = trainer.checkpointer
    saves = {True: [], False: []}  # checksum -> [(wall, cpu)]
    hashing_save = []
    for i in range(repeat):
        for checksum in (False, True):  # alternating: both see the same machine load
            ckpt.cfg.checksum = checksum
            trainer.step = 2 * i + 1 + checksum
            work = CLOCK.measure(lambda: saves[checksum].append(_timed(lambda: ckpt.save(trainer.step))))
            if checksum:
                hashing_save.append(work)
    ckpt.cfg.checksum = True
    step_dir = out / "checkpoint" / f"step-{2 * repeat}"  # the newest, saved with checksums
    size = sum(f.stat().st_size for f in step_dir.iterdir())
    t0 = time.perf_counter()
    assert verify_checksums(step_dir) is None
    scan = time.perf_counter() - t0

    blocked, total = [], []
    ckpt.cfg.async_mode = "async"
    for i in range(repeat):
        trainer.step = 2 * repeat + i + 1
        t0 = time.perf_counter()
        _quiet(ckpt.save, trainer.step)
        blocked.append(time.perf_counter() - t0)
        _quiet(ckpt._wait)
        total.append(time.perf_counter() - t0)
    trainer.close()

    loads = {True: [], False: []}  # checksum -> [(wall, cpu)] of a resume (verified while read, or not)
    hashing_load = []
    for _ in range(repeat):
        for checksum in (False, True):
            fresh = _quiet(_trainer, out, flavor, tokenizer, "disabled")
            fresh.checkpointer.cfg.checksum = checksum
            work = CLOCK.measure(lambda: loads[checksum].append(_timed(fresh.checkpointer.load)))
            if checksum:
                hashing_load.append(work)
            assert fresh.step == 3 * repeat
            fresh.close()
    # the finite check a resume runs on the loaded model and optimizer (one fused norm per tensor), alone
    named = sorted(
        (k, v)
        for part in ("model", "optimizer")
        for k, v in _flat_state(fresh, part).items()
        if isinstance(v, torch.Tensor)
    )
    (finite_cpu,) = _median_cpu_s([lambda: fresh.checkpointer._first_non_finite(named, "the bench")], repeat)

    validation = bench_validation(out / "checkpoint" / f"step-{3 * repeat}", repeat)
    t0 = time.perf_counter()
    export_hf(out / "checkpoint" / f"step-{3 * repeat}", out / "hf")
    export = time.perf_counter() - t0

    def med(runs, i):
        return statistics.median(r[i] for r in runs)

    return {
        "flavor": flavor,
        "params": trainer.num_params,
        "size_mib": size / 2**20,
        "save_s": med(saves[True], 0),
        "save_plain_s": med(saves[False], 0),
        "save_cpu_s": med(saves[True], 1),
        "save_plain_cpu_s": med(saves[False], 1),
        "load_s": med(loads[True], 0),
        "load_plain_s": med(loads[False], 0),
        "load_cpu_s": med(loads[True], 1),
        "load_plain_cpu_s": med(loads[False], 1),
        "finite_cpu_s": finite_cpu,
        "hashing_save_s": statistics.median(h[0] for h in hashing_save),
        "hashing_load_s": statistics.median(h[0] for h in hashing_load),
        "exposed_save_s": statistics.median(h[1] for h in hashing_save),
        "exposed_load_s": statistics.median(h[1] for h in hashing_load),
        "scan_s": scan,
        "async_blocked_s": statistics.median(blocked),
        "async_total_s": statistics.median(total),
        "export_hf_s": export,
        **validation,
    }


def _flat_state(trainer: Trainer, part: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from titanlike.checkpoint.parts import OPTIM_OPTIONS, flatten

    model = trainer.checkpointer.model
    if part == "model":
        return flatten({"model": get_model_state_dict(model)})
    return flatten({"optimizer": get_optimizer_state_dict(model, trainer.optimizer, options=OPTIM_OPTIONS)})


def _crc32c_gb_s() -> float:
    from titanlike.checkpoint.checksums import crc32c_hex

    buf = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy()
    best = min(_median_cpu_s([lambda: crc32c_hex(buf)], 1)[0] for _ in range(3))
    return len(buf) / best / 1e9


CLOCK: _ChecksumClock


def main() -> int:
    global CLOCK
    CLOCK = _ChecksumClock()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="scratch folder (deleted and rewritten)")
    parser.add_argument("--flavor", action="append", help="model flavors (default: debugmodel and gpt2_small)")
    parser.add_argument("--tokenizer", default="test", help="tokenizer (sets the vocabulary; default: test, 2k)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (the median is reported)")
    args = parser.parse_args()
    flavors = args.flavor or ["debugmodel", "gpt2_small"]  # gpt2_small's shape with the 2k vocabulary: 115M
    print(
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, "
        f"crc32c {_crc32c_gb_s():.1f} GB/s (one core, CPU time)"
    )
    results = [bench(Path(args.out) / flavor, flavor, args.tokenizer, args.repeat) for flavor in flavors]
    print(
        "\nCheckpoint checksums (checkpoint.checksum, CRC32C of every entry: computed while written, verified while "
        "read), side by side, medians; wall-clock and this process's CPU time (other work on a shared machine "
        "inflates the first, not the second):\n"
        "| model | parameters | checkpoint | save | save, no checksums | difference (wall / CPU) | checksum CPU "
        "work | save held up / save | resume | resume, no checksums | difference (wall / CPU) | checksum CPU work | "
        "resume held up / resume | finite check (CPU) / resume (CPU) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['flavor']} | {r['params'] / 1e6:.1f}M | {r['size_mib']:.0f} MiB | {r['save_s']:.2f} s | "
            f"{r['save_plain_s']:.2f} s | {r['save_s'] / r['save_plain_s'] - 1:+.1%} / "
            f"{r['save_cpu_s'] / r['save_plain_cpu_s'] - 1:+.1%} | {r['hashing_save_s'] * 1e3:.0f} ms | "
            f"{r['exposed_save_s'] * 1e3:.0f} ms / {r['exposed_save_s'] / r['save_s']:.2%} | {r['load_s']:.2f} s | "
            f"{r['load_plain_s']:.2f} s | {r['load_s'] / r['load_plain_s'] - 1:+.1%} / "
            f"{r['load_cpu_s'] / r['load_plain_cpu_s'] - 1:+.1%} | {r['hashing_load_s'] * 1e3:.0f} ms | "
            f"{r['exposed_load_s'] * 1e3:.0f} ms / {r['exposed_load_s'] / r['load_s']:.2%} | "
            f"{r['finite_cpu_s'] * 1e3:.1f} ms / {r['finite_cpu_s'] / r['load_cpu_s']:.2%} |",
            flush=True,
        )
    print(
        "\n| model | async: training blocked | async: until committed | full checksum scan (verify_checksums) | "
        "HF export |"
    )
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['flavor']} | {r['async_blocked_s']:.2f} s | {r['async_total_s']:.2f} s | {r['scan_s']:.2f} s | "
            f"{r['export_hf_s']:.2f} s |",
            flush=True,
        )
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
