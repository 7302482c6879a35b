"""Tokenize a corpus once into memory-mappable .bin shards (+ .bin.json sidecars) for training.

    python scripts/preprocess_data.py --tokenizer path/to/Llama-3.1-8B --input fineweb/*.parquet c4/ --output data/web
    python scripts/preprocess_data.py --tokenizer gpt2 --input corpus/ --output data/corpus.bin      # one file

Inputs are files, folders or globs of every format training reads (.txt, .jsonl, .jsonl.gz / .json.gz, .jsonl.zst
/ .json.zst, .parquet with the text in --text-field); every document is followed by the tokenizer's EOS, exactly
as training on the raw inputs would read them. A folder --output gets shards of at most --shard-tokens tokens,
written by --workers processes (default: every core), each shard atomically; rerunning the same command resumes
(finished shards are kept). A .bin --output is one file written by one process. --benchmark measures the
throughput side by side with a plain loop over the tokenizer's own batch encoder (same text, same threads).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from titanlike.data import build_tokenizer, iter_token_chunks, write_token_file  # noqa: E402
from titanlike.data.preprocess import benchmark, count_shards, preprocess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer",
        required=True,
        help='"gpt2", "cl100k", "test", a .tiktoken rank file, or a Hugging Face tokenizer folder / tokenizer.json',
    )
    parser.add_argument("--input", required=True, nargs="+", help="files, folders or globs, read in order")
    parser.add_argument("--output", help="a folder for the shards, or a .bin to write one file (its sidecar .bin.json)")
    parser.add_argument("--text-field", default="text", help="the JSON key / parquet column holding the text")
    parser.add_argument("--encoding", default="utf-8", help="of .txt and JSON lines inputs")
    parser.add_argument("--encoding-errors", default="strict", choices=("strict", "replace", "ignore"))
    parser.add_argument("--workers", type=int, default=None, help="processes (default: every core; a .bin: 1)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard (default 2^27)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--benchmark", action="store_true", help="tokens/s against the plain batch-encoder loop")
    parser.add_argument("--repeat", type=int, default=3, help="--benchmark: alternated runs of each (median)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.benchmark:
            return _benchmark(args)
        if not args.output:
            raise ValueError("--output is required: a folder for the shards, or a .bin for one file")
        tokenizer = build_tokenizer(args.tokenizer)
        if args.output.endswith(".bin"):
            if args.workers not in (None, 1):
                raise ValueError("a single .bin is written by one process; give a folder --output to use --workers")
            chunks = iter_token_chunks(args.input, tokenizer, args.text_field, args.encoding, args.encoding_errors)
            n_tokens = write_token_file(chunks, args.output, tokenizer)
            print(
                f"wrote {n_tokens:,} tokens ({tokenizer.name}, vocab {tokenizer.vocab_size}) to {args.output} "
                f"in {time.perf_counter() - start:.1f}s"
            )
            return 0
        r = preprocess(
            args.input,
            args.output,
            tokenizer,
            workers=args.workers or os.cpu_count() or 1,
            shard_tokens=args.shard_tokens,
            text_field=args.text_field,
            encoding=args.encoding,
            errors=args.encoding_errors,
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shards, tokens = count_shards(args.output)
    if r.problems:
        print(
            f"error: {len(r.problems)} bad input{'s' if len(r.problems) > 1 else ''} (the other units' shards are "
            f"written; fix them and rerun to resume): " + "; ".join(r.problems),
            file=sys.stderr,
        )
        return 2
    print(
        f"wrote {r.tokens:,} tokens in {r.shards} shard(s) ({tokenizer.name}, vocab {tokenizer.vocab_size}) to "
        f"{args.output} in {r.seconds:.1f}s ({r.tokens / max(r.seconds, 1e-9):,.0f} tokens/s); "
        + (f"{r.skipped} of {r.units} units were done already; " if r.skipped else "")
        + f"the folder holds {tokens:,} tokens in {shards} shards"
    )
    return 0


def _benchmark(args) -> int:
    workers = args.workers or os.cpu_count() or 1
    r = benchmark(args.input, args.tokenizer, workers, repeat=args.repeat, text_field=args.text_field)
    print(
        f"preprocess {args.tokenizer}, {r['tokens']:,} tokens, {workers} worker(s) / thread(s), {args.repeat} "
        f"alternated runs: ours {', '.join(f'{x:,.0f}' for x in r['ours'])} tokens/s; plain batch-encoder loop "
        f"{', '.join(f'{x:,.0f}' for x in r['plain'])} tokens/s; ratio of medians {r['ratio']:.3f} (per CPU "
        f"second: {r['cpu_ratio']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
