"""Tokenize a corpus once into ``.bin`` shards of a bounded size, on every core, resumably.

The inputs (files, folders, globs of every format in formats.py) are cut into *units*: a file, or for a parquet file
runs of row groups of about ``UNIT_BYTES`` of uncompressed text (compressed JSON lines cannot be split). Each unit
is tokenized by one worker process (``workers`` of them, each encoding on one thread) into shards named
``shard-<unit>-<part>.bin``: part k holds the unit's tokens [k S, (k + 1) S) for ``S = shard_tokens`` (a document
may continue in the next part; read in name order the shards are exactly the stream one .bin of the inputs would
hold). Every shard is written under a temporary name and renamed with its sidecar (atomic); its sidecar records
where in the unit's documents it ends, so a rerun skips finished units (a marker in ``<output>/.preprocess/``)
and continues an unfinished one after its last complete shard. ``<output>/.preprocess/manifest.json`` records the
inputs, the tokenizer and the shard size: a rerun with other settings is refused, an input whose size or mtime
changed has its shards redone. Memory per worker: one batch of documents (``BATCH_CHARS``) and one parquet row
group. Progress (documents, tokens, tokens/s) goes to stderr; a bad input fails its unit only, and every bad input
is reported at the end in one line (the finished shards stay, for the rerun).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlike.data.formats import expand_paths, file_kind, iter_documents, parquet_column
from titanlike.data.shards import TokenWriter, read_sidecar, sidecar_path, token_dtype, tokenizer_identity

UNIT_BYTES = 256 << 20  # uncompressed bytes of text per parquet unit
BATCH_CHARS = 4 << 20  # characters tokenized per encoder call
STATE = ".preprocess"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Unit:
    index: int
    path: str
    row_groups: tuple[int, int] | None = None  # [first, last) row groups of a parquet file; None: the whole file

    def describe(self) -> str:
        rg = f" row groups {self.row_groups[0]}..{self.row_groups[1] - 1}" if self.row_groups else ""
        return f"{self.path}{rg}"


def plan_units(inputs: list[str], text_field: str) -> list[Unit]:
    """The units of the inputs, in order (independent of the number of workers)."""
    units: list[Unit] = []
    for f in expand_paths(inputs):
        kind = file_kind(f)
        if kind[0] == "bin":
            raise ValueError(f"input {f} is already tokenized: list it in data.path as it is")
        if kind[0] != "parquet":
            units.append(Unit(len(units), str(f)))
            continue
        pf, col = parquet_column(f, text_field)
        n, first, size = pf.metadata.num_row_groups, 0, 0
        for i in range(n):
            size += pf.metadata.row_group(i).column(col).total_uncompressed_size
            if size >= UNIT_BYTES or i == n - 1:
                units.append(Unit(len(units), str(f), (first, i + 1) if (first, i + 1) != (0, n) else None))
                first, size = i + 1, 0
        if n == 0:
            units.append(Unit(len(units), str(f)))
    return units


def _unit_documents(unit: Unit, text_field: str, encoding: str, errors: str) -> Iterator[str]:
    if unit.row_groups is None:
        yield from iter_documents(Path(unit.path), text_field, encoding, errors)
        return
    pf, _ = parquet_column(Path(unit.path), text_field)
    first_row = sum(pf.metadata.row_group(i).num_rows for i in range(unit.row_groups[0]))
    for g in range(*unit.row_groups):
        values = pf.read_row_group(g, columns=[text_field]).column(0).to_pylist()
        for j, text in enumerate(values):
            if text is None:
                raise ValueError(f"{unit.path}: row {first_row + j} has a null {text_field!r}; drop or fill it")
            yield text
        first_row += len(values)


# ---------------------------------------------------------------------------------------------
# One unit (in a worker process)


def shard_name(unit: int, part: int) -> str:
    return f"shard-{unit:05d}-{part:05d}.bin"


def _done_marker(out: Path, unit: int) -> Path:
    return out / STATE / f"unit-{unit:05d}.done"


def _resume_point(out: Path, unit: Unit) -> tuple[int, int, int]:
    """(next part, document, token offset in it) after the unit's complete shards."""
    part, doc, offset = 0, 0, 0
    while (out / shard_name(unit.index, part)).is_file() and sidecar_path(out / shard_name(unit.index, part)).is_file():
        src = read_sidecar(out / shard_name(unit.index, part)).get("source", {})
        if src.get("unit") != unit.index or src.get("part") != part:
            break
        doc, offset = src["end"]
        part += 1
    for stale in out.glob(f"shard-{unit.index:05d}-*.bin"):  # shards after a gap, from an older attempt
        if int(stale.stem.rsplit("-", 1)[1]) >= part:
            stale.unlink()
            sidecar_path(stale).unlink(missing_ok=True)
    return part, doc, offset


_worker: dict = {}  # in a worker process: the progress queue, the tokenizer and the settings


def _init_worker(queue, threads_env: dict[str, str], settings: dict) -> None:
    os.environ.update(threads_env)
    _worker.update(settings, queue=queue)


def _run_in_worker(unit: Unit):
    w = _worker
    return run_unit(
        unit, w["out"], w["tokenizer"], w["shard_tokens"], w["text_field"], w["encoding"], w["errors"], w["queue"]
    )


def run_unit(
    unit: Unit, out: str, tokenizer, shard_tokens: int, text_field: str, encoding: str, errors: str, queue=None
):
    """Tokenize one unit into its shards; returns (unit index, tokens written now, shards written now, skipped)."""
    out_dir = Path(out)
    marker = _done_marker(out_dir, unit.index)
    if marker.is_file():
        return unit.index, 0, 0, True
    part, doc0, offset0 = _resume_point(out_dir, unit)
    if doc0 is None:  # the last shard was written, the marker not yet
        _write_json(marker, {"unit": unit.index, "input": unit.path, "shards": part})
        return unit.index, 0, 0, True
    dtype = token_dtype(tokenizer.vocab_size)
    written = shards = 0
    writer: TokenWriter | None = None
    pending: list[tuple[int, str]] = []
    chars = 0
    last_report = time.monotonic()
    reported_docs = reported_tokens = 0

    def report(force: bool = False) -> None:
        nonlocal last_report, reported_docs, reported_tokens
        if queue is not None and (force or time.monotonic() - last_report > 0.25):
            queue.put((reported_docs, reported_tokens))
            reported_docs = reported_tokens = 0
            last_report = time.monotonic()

    def emit(flat: np.ndarray, docs: list[int], starts: np.ndarray, pos: int) -> None:
        """Append a batch's tokens from ``flat[pos]`` on, cutting a shard every ``shard_tokens`` tokens; document
        ``docs[k]`` starts at ``flat[starts[k]]`` (the position a shard ends at is recorded for a resume)."""
        nonlocal writer, part, written, shards
        while pos < len(flat):
            if writer is None:
                writer = TokenWriter(out_dir / shard_name(unit.index, part), tokenizer)
            take = min(len(flat) - pos, shard_tokens - writer.n_tokens)
            writer.write(flat[pos : pos + take])
            pos += take
            if writer.n_tokens == shard_tokens:
                k = int(np.searchsorted(starts, pos, side="right")) - 1
                end = [docs[-1] + 1, 0] if pos == len(flat) else [docs[k], pos - int(starts[k])]
                written += writer.commit(source={"unit": unit.index, "part": part, "input": unit.path, "end": end})
                writer, part, shards = None, part + 1, shards + 1

    def flush() -> None:
        nonlocal chars, reported_docs, reported_tokens
        if not pending:
            return
        ids = tokenizer.encode_batch([t for _, t in pending], eos=True, num_threads=1)  # one thread per worker
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lens.sum()))
        docs = [d for d, _ in pending]
        emit(flat, docs, np.cumsum(lens) - lens, offset0 if docs[0] == doc0 else 0)
        reported_tokens += len(flat)
        reported_docs += len(pending)
        pending.clear()
        chars = 0
        report()

    try:
        for d, text in enumerate(_unit_documents(unit, text_field, encoding, errors)):
            if d < doc0 or not text:
                continue
            pending.append((d, text))
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
        flush()
        if writer is not None and writer.n_tokens:
            written += writer.commit(source={"unit": unit.index, "part": part, "input": unit.path, "end": [None, None]})
            writer, shards, part = None, shards + 1, part + 1
        report(force=True)
    except BaseException:
        if writer is not None:
            writer.abort()
        report(force=True)
        raise
    _write_json(marker, {"unit": unit.index, "input": unit.path, "shards": part})
    return unit.index, written, shards, False


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The run (in the main process)


def _manifest(units: list[Unit], tokenizer, shard_tokens: int, text_field: str, encoding: str, errors: str):
    return {
        "version": MANIFEST_VERSION,
        **tokenizer_identity(tokenizer),
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "encoding": encoding,
        "encoding_errors": errors,
        "units": [
            {
                "path": u.path,
                "row_groups": list(u.row_groups) if u.row_groups else None,
                "size": os.stat(u.path).st_size,
                "mtime_ns": os.stat(u.path).st_mtime_ns,
            }
            for u in units
        ],
    }


def _reconcile(out: Path, manifest: dict) -> int:
    """Compare with a previous run's manifest: refuse other settings; forget the shards of changed inputs. Returns
    the number of units whose shards were dropped."""
    path = out / STATE / "manifest.json"
    if not path.is_file():
        if any(out.glob("shard-*.bin")):
            raise ValueError(f"{out} holds shards but no {STATE}/manifest.json; use an empty or new --output folder")
        return 0
    old = json.loads(path.read_text())
    same = ("version", "tokenizer", "vocab_size", "eos_id", "tokenizer_sha256", "shard_tokens", "text_field")
    diff = [k for k in same + ("encoding", "encoding_errors") if old.get(k) != manifest.get(k)]
    old_units = [(u["path"], u["row_groups"]) for u in old.get("units", [])]
    new_units = [(u["path"], u["row_groups"]) for u in manifest["units"]]
    if old_units != new_units:
        diff.append("the inputs")
    if diff:
        raise ValueError(
            f"{out} holds the shards of another preprocessing ({', '.join(diff)} differ); rerun with the same "
            f"settings to resume, or use a new --output folder"
        )
    dropped = 0
    for i, (a, b) in enumerate(zip(old["units"], manifest["units"])):
        if (a["size"], a["mtime_ns"]) != (b["size"], b["mtime_ns"]):
            for f in out.glob(f"shard-{i:05d}-*.bin"):
                f.unlink()
                sidecar_path(f).unlink(missing_ok=True)
            _done_marker(out, i).unlink(missing_ok=True)
            dropped += 1
    return dropped


def _remove_temporaries(out: Path) -> None:
    for f in list(out.glob(".shard-*")) + list((out / STATE).glob(".*.tmp")):
        f.unlink(missing_ok=True)


class Progress:
    """documents, tokens and tokens/s on stderr: rewritten in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, n_units: int, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = enabled
        self.n_units, self.done, self.docs, self.tokens = n_units, 0, 0, 0
        self.start = self.last = time.monotonic()

    def add(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return (
            f"preprocess: {self.done}/{self.n_units} units  {self.docs:,} documents  {self.tokens:,} tokens  "
            f"{self.tokens / elapsed:,.0f} tokens/s  {elapsed:.0f}s"
        )

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty and (final or now - self.last >= 0.2):
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        elif not self.tty and (final or now - self.last >= 10.0):
            self.stream.write(self.line() + "\n")
        else:
            return
        self.stream.flush()
        self.last = now


@dataclass
class Result:
    tokens: int  # written by this run
    shards: int  # written by this run
    units: int
    skipped: int  # units finished by an earlier run
    seconds: float
    problems: list[str]


def preprocess(
    inputs: list[str],
    output: str | os.PathLike,
    tokenizer,
    *,
    workers: int = 1,
    shard_tokens: int = 1 << 27,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
    progress: bool = True,
) -> Result:
    """Tokenize ``inputs`` into shards under the folder ``output`` (see the module doc)."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is a file; give a folder for the shards (or a .bin for one file)")
    t0 = time.monotonic()
    units = plan_units(inputs, text_field)
    manifest = _manifest(units, tokenizer, shard_tokens, text_field, encoding, errors)
    out.mkdir(parents=True, exist_ok=True)
    _reconcile(out, manifest)
    _remove_temporaries(out)
    _write_json(out / STATE / "manifest.json", manifest)

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    bar = Progress(len(units), enabled=progress)
    tokens = shards = skipped = 0
    problems: list[str] = []
    threads_env = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}  # one encoding thread per worker
    settings = dict(
        out=str(out),
        tokenizer=tokenizer,
        shard_tokens=shard_tokens,
        text_field=text_field,
        encoding=encoding,
        errors=errors,
    )  # handed to the forked workers once (not pickled per unit)
    with cf.ProcessPoolExecutor(
        max_workers=min(workers, len(units)) or 1,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(queue, threads_env, settings),
    ) as pool:
        pending = {pool.submit(_run_in_worker, u) for u in units}
        try:
            while pending:
                finished, pending = cf.wait(pending, timeout=0.2)
                while not queue.empty():
                    bar.add(*queue.get())
                for fut in finished:
                    bar.done += 1
                    try:
                        _, n, s, was_done = fut.result()
                    except (ValueError, OSError) as e:
                        problems.append(str(e))
                        continue
                    tokens, shards, skipped = tokens + n, shards + s, skipped + was_done
                bar.show()
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        finally:
            time.sleep(0.05)
            while not queue.empty():
                bar.add(*queue.get())
            bar.show(final=True)
            _remove_temporaries(out)
    return Result(tokens, shards, len(units), skipped, time.monotonic() - t0, problems)


def count_shards(output: str | os.PathLike) -> tuple[int, int]:
    """(shards, tokens) in an output folder, from the sidecars."""
    files = sorted(Path(output).glob("shard-*.bin"))
    return len(files), sum(int(read_sidecar(f)["n_tokens"]) for f in files)


# ---------------------------------------------------------------------------------------------
# Throughput, side by side with the tokenizer's own batch encoder


def _plain_loop(inputs, tokenizer_spec, text_field, encoding, errors, threads) -> tuple[int, float, float]:
    """Every document in memory first (untimed), then the tokenizer's own batch encoder over batches of BATCH_CHARS
    characters on ``threads`` threads (timed): (tokens, wall seconds, CPU seconds)."""
    from titanlike.data.tokenizer import build_tokenizer

    tok = build_tokenizer(tokenizer_spec)
    docs = [d for f in expand_paths(inputs) for d in iter_documents(f, text_field, encoding, errors) if d]
    batches, batch, chars = [], [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    batches += [batch] if batch else []
    backend = getattr(tok, "backend", None)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for b in batches:
        if backend is not None:  # tokenizers: its rayon pool, RAYON_NUM_THREADS threads
            n += sum(len(e.ids) for e in backend.encode_batch_fast(b, add_special_tokens=False))
        else:  # tiktoken
            n += sum(len(x) for x in tok.encoding.encode_ordinary_batch(b, num_threads=threads))
    # + one eos per document, as the shards hold; wall seconds, CPU seconds (every thread of the process)
    return n + len(docs), time.perf_counter() - t0, time.process_time() - c0


def plain_loop(inputs, tokenizer_spec: str, threads: int, text_field="text", encoding="utf-8", errors="strict"):
    """(tokens, wall seconds, CPU seconds) of the plain loop, in a fresh interpreter (a thread pool of its own:
    ``threads`` threads)."""
    import subprocess

    args = json.dumps([list(map(str, inputs)), tokenizer_spec, text_field, encoding, errors, threads])
    code = "import json, sys; from titanlike.data.preprocess import _plain_loop; "
    code += "print(json.dumps(_plain_loop(*json.loads(sys.argv[1]))))"
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "RAYON_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "true",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    proc = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"the plain loop failed: {proc.stderr[-2000:]}")
    n, seconds, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    return n, seconds, cpu


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (the pool's workers) so far."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def benchmark(
    inputs: list[str],
    tokenizer_spec: str,
    workers: int,
    repeat: int = 3,
    text_field: str = "text",
    scratch: str | os.PathLike | None = None,
) -> dict:
    """`preprocess` (its whole run: start-up, reading, tokenizing, writing shards) against the plain loop, alternated
    ``repeat`` times: tokens per wall second and per CPU second of each (the CPU time of every process and thread
    involved: the measure that other jobs on the machine disturb least), and the medians' ratios."""
    import shutil
    import statistics
    import tempfile

    from titanlike.data.tokenizer import build_tokenizer

    tok = build_tokenizer(tokenizer_spec)
    ours, plain, ours_cpu, plain_cpu, n_tokens = [], [], [], [], None
    for _ in range(repeat):
        out = Path(tempfile.mkdtemp(prefix="preprocess-bench-", dir=scratch))
        try:
            c0 = _cpu_seconds()
            r = preprocess(inputs, out, tok, workers=workers, text_field=text_field, progress=False)
            cpu = _cpu_seconds() - c0
            if r.problems:
                raise ValueError("; ".join(r.problems))
            ours.append(r.tokens / r.seconds)
            ours_cpu.append(r.tokens / cpu)
            n_tokens = r.tokens
        finally:
            shutil.rmtree(out, ignore_errors=True)
        n, seconds, cpu = plain_loop(inputs, tokenizer_spec, workers, text_field)
        if n != n_tokens:
            raise RuntimeError(f"the plain loop counted {n} tokens, the shards hold {n_tokens}")
        plain.append(n / seconds)
        plain_cpu.append(n / cpu)
    med = statistics.median
    return {
        "tokens": n_tokens,
        "workers": workers,
        "ours": ours,
        "plain": plain,
        "ratio": med(ours) / med(plain),
        "ours_cpu": ours_cpu,
        "plain_cpu": plain_cpu,
        "cpu_ratio": med(ours_cpu) / med(plain_cpu),
    }
