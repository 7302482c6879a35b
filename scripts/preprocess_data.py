"""Tokenize a corpus once into a memory-mappable .bin (+ .bin.json sidecar) for training.

    python scripts/preprocess_data.py --tokenizer gpt2 --input corpus/ --output data/corpus.bin

Inputs are a text file, a folder of .txt/.jsonl files, a .jsonl file (text under --text-field) or
several of those; every document is followed by the tokenizer's EOS, exactly as training on the
raw inputs would read them. The output is written to a temporary file and renamed into place.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from titanlike.data import build_tokenizer, iter_token_chunks, write_token_file  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", required=True, help='"gpt2", "cl100k", "test" or a path to a .tiktoken rank file'
    )
    parser.add_argument("--input", required=True, nargs="+", help="text/.jsonl files or folders, read in order")
    parser.add_argument("--output", required=True, help="the .bin to write (its sidecar is <output>.json)")
    parser.add_argument("--text-field", default="text", help="the JSON key holding the text in .jsonl inputs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        n_tokens = write_token_file(iter_token_chunks(args.input, tokenizer, args.text_field), args.output, tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {n_tokens:,} tokens ({tokenizer.name}, vocab {tokenizer.vocab_size}) to {args.output} "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
