"""Data at scale, measured on this machine: start-up and memory of many .bin shards, and preprocessing throughput.

    python scripts/bench_data.py shards --sets 1000:4e6 200:2e7 --dir /tmp/shards_bench
    python scripts/bench_data.py preprocess --tokenizer gpt2 --workers 2 --mib 64 --repeat 5 --dir /tmp/pre_bench
    python scripts/bench_data.py preprocess --tokenizer hf:cl100k ...   # the tokenizers library, 100k vocabulary

``shards`` writes, for each set, synthetic shards (random ids of the ``test`` tokenizer, uint16, with version-2
sidecars) into ``--dir``; then for a tenth, a quarter and all of them starts two fresh processes side by side,
data-parallel ranks 0 and 1 of 2, each building the run's data exactly as the trainer does (``build_corpus``: every
shard checked and indexed; ``build_dataloader``) and reading ``--batches`` batches of 8 x 2048 tokens. Each reports
its start-up time (checks + index), the growth of its resident memory (above the same process right after its
imports) after the start-up and after the batches, and its peak resident memory; one more run shows the old path
(``load_token_stream``: the shards concatenated in memory) on a tenth of the first set. The shards are deleted at the
end. ``preprocess`` writes ``--mib`` MiB of JSON lines (gzip, 16 files, documents cut from the shipped corpus) and
runs ``titanlike.data.preprocess.benchmark``: the whole preprocessing run against a plain loop over the tokenizer's
own batch encoder, same text, same number of threads, alternated ``--repeat`` times. ``--tokenizer hf:cl100k`` is the
shipped cl100k rank file converted to a tokenizer.json by transformers' ``TikTokenConverter``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import numpy as np  # noqa: E402


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(args) -> None:
    """One data-parallel rank: build the data as the trainer does, read batches, print a JSON line."""
    from titanlike.data import build_corpus, build_dataloader, build_tokenizer, load_token_stream

    tok = build_tokenizer("test")
    files = sorted(Path(args.dir).glob("*.bin"))[: args.n_shards]
    base = _rss_now()
    t0 = time.perf_counter()
    if args.old:
        windows = load_token_stream(files, tok)
    else:
        windows = build_corpus([str(f) for f in files], tok, seq_len=2048, val_fraction=0.0).windows(seed=0)
    loader = build_dataloader(
        windows, seq_len=2048, global_batch_size=16, local_batch_size=8, dp_rank=args.rank, dp_degree=2, seed=0
    )
    startup = time.perf_counter() - t0
    after_startup = _rss_now()
    it = iter(loader)
    t1 = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    per_batch = (time.perf_counter() - t1) / args.batches
    result = {
        "startup_s": startup,
        "rss_imports": base,
        "rss_startup": after_startup - base,
        "rss_batches": _rss_now() - base,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps({**result, "batch_ms": 1e3 * per_batch}))


def _write_shards(folder: Path, n_shards: int, n_tokens: int) -> None:
    from titanlike.data import build_tokenizer
    from titanlike.data.shards import TokenWriter

    tok = build_tokenizer("test")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = n_tokens // n_shards
    for i in range(n_shards):
        with TokenWriter(folder / f"shard-{i:05d}.bin", tok) as w:
            left = per
            while left:
                n = min(left, 1 << 24)
                w.write(rng.integers(0, tok.vocab_size, n, dtype=np.uint16))
                left -= n
            w.commit()


def _run_ranks(folder: Path, n_shards: int, batches: int, old: bool) -> list[dict]:
    cmd = [sys.executable, __file__, "_rank", "--dir", str(folder), "--n-shards", str(n_shards)]
    cmd += ["--batches", str(batches)] + (["--old"] if old else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {outs}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def shards(args) -> None:
    root = Path(args.dir)
    rows = []
    try:
        for spec in args.sets:
            n_shards, per = (int(float(x)) for x in spec.split(":"))
            folder = root / f"n{n_shards}_t{per}"
            t0 = time.perf_counter()
            _write_shards(folder, n_shards, n_shards * per)
            print(f"wrote {n_shards} shards of {per:,} tokens in {time.perf_counter() - t0:.0f}s", flush=True)
            for n in sorted({max(1, n_shards // 10), max(1, n_shards // 4), n_shards}):
                rows.append((n, n * per, _run_ranks(folder, n, args.batches, old=False)))
            if spec == args.sets[0]:
                n_old = max(1, n_shards // 10)
                old = (n_old, n_old * per, _run_ranks(folder, n_old, args.batches, old=True))
            shutil.rmtree(folder)
        print(
            "| shards | tokens | on disk | start-up (s) | RSS growth: start-up | + batches | peak RSS of the process "
            "| ms per batch |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

        def mib(x):
            return f"{x / 2**20:,.1f}"

        for n, total, ranks in rows:
            cells = [
                f"{n:,}",
                f"{total / 1e9:.2f}B",
                f"{2 * total / 2**30:.1f} GiB",
                " / ".join(f"{r['startup_s']:.2f}" for r in ranks),
                " / ".join(mib(r["rss_startup"]) + " MiB" for r in ranks),
                " / ".join(mib(r["rss_batches"]) + " MiB" for r in ranks),
                " / ".join(mib(r["peak"]) + " MiB" for r in ranks),
                " / ".join(f"{r['batch_ms']:.2f}" for r in ranks),
            ]
            print("| " + " | ".join(cells) + " |")
        n, total, ranks = old
        print(
            f"old path (load_token_stream: the shards concatenated in memory), {n} shards, {total / 1e9:.2f}B tokens: "
            "start-up "
            + " / ".join(f"{r['startup_s']:.2f}" for r in ranks)
            + " s, RSS growth "
            + " / ".join(mib(r["rss_batches"]) + " MiB" for r in ranks)
            + ", peak RSS "
            + " / ".join(mib(r["peak"]) + " MiB" for r in ranks)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _hf_cl100k(folder: Path) -> str:
    """A Hugging Face tokenizer.json of the shipped cl100k rank file (transformers' TikTokenConverter: the same ids
    as tiktoken's), to time the tokenizers library on a real 100k vocabulary."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from titanlike.data import asset_path
    from titanlike.data.tokenizer import CL100K_PATTERN

    rank_file = str(asset_path("tokenizers", "cl100k_base.tiktoken"))
    converter = TikTokenConverter(vocab_file=rank_file, pattern=CL100K_PATTERN, additional_special_tokens=[EOT])
    folder.mkdir(parents=True, exist_ok=True)
    converter.converted().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    return str(folder)


EOT = "<|endoftext|>"


def preprocess(args) -> None:
    import gzip
    import random

    from titanlike.data import asset_path
    from titanlike.data.preprocess import benchmark

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        text = "\n\n".join(
            p.read_text(encoding="utf-8")
            for p in [asset_path("corpus", "tinyshakespeare.txt"), *sorted(asset_path("corpus", "gutenberg").iterdir())]
        )
        paras = [p for p in text.split("\n\n") if p.strip()]
        rng = random.Random(0)
        per_file = (args.mib << 20) // 16
        for k in range(16):
            with gzip.open(root / f"web-{k:02d}.jsonl.gz", "wt", encoding="utf-8") as f:
                size = 0
                while size < per_file:
                    doc = "\n\n".join(rng.sample(paras, rng.randint(2, 12)))
                    f.write(json.dumps({"text": doc}) + "\n")
                    size += len(doc)
        spec = _hf_cl100k(root / "cl100k_hf") if args.tokenizer == "hf:cl100k" else args.tokenizer
        r = benchmark([str(root / "web-*.jsonl.gz")], spec, args.workers, args.repeat, scratch=str(root))
        print(
            f"preprocess {args.tokenizer}: {r['tokens']:,} tokens ({args.mib} MiB of text in 16 .jsonl.gz files), "
            f"{args.workers} worker(s) vs the plain loop on {args.workers} thread(s), {args.repeat} alternated runs"
        )
        print("  ours  (tokens per wall second): " + ", ".join(f"{x:,.0f}" for x in r["ours"]))
        print("  plain (tokens per wall second): " + ", ".join(f"{x:,.0f}" for x in r["plain"]))
        print(f"  ratio of the medians: {r['ratio']:.3f}")
        print("  ours  (tokens per CPU second): " + ", ".join(f"{x:,.0f}" for x in r["ours_cpu"]))
        print("  plain (tokens per CPU second): " + ", ".join(f"{x:,.0f}" for x in r["plain_cpu"]))
        print(f"  ratio of the medians: {r['cpu_ratio']:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shards")
    s.add_argument("--sets", nargs="+", default=["1000:4e6", "200:2e7"], help="SHARDS:TOKENS_PER_SHARD")
    s.add_argument("--batches", type=int, default=200)
    s.add_argument("--dir", default="/tmp/titanlike_shards_bench")
    p = sub.add_parser("preprocess")
    p.add_argument("--tokenizer", default="gpt2", help="any tokenizer, or hf:cl100k")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="/tmp/titanlike_preprocess_bench")
    r = sub.add_parser("_rank")
    r.add_argument("--dir", required=True)
    r.add_argument("--n-shards", type=int, required=True)
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--batches", type=int, default=200)
    r.add_argument("--old", action="store_true")
    args = parser.parse_args()
    {"shards": shards, "preprocess": preprocess, "_rank": _rank}[args.cmd](args)


if __name__ == "__main__":
    main()
