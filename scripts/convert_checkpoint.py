"""Convert between titanlike checkpoints (DCP, any layout) and Hugging Face weights (safetensors + config.json).

    # a checkpoint (a step folder, or a checkpoint folder: its newest step) -> a folder transformers loads as it is:
    # model.safetensors (or shards above --max-shard-size), config.json, generation_config.json, the tokenizer
    python scripts/convert_checkpoint.py to-hf outputs/debug/checkpoint outputs/debug/hf
    python scripts/convert_checkpoint.py to-hf outputs/8b/checkpoint/step-1000 outputs/8b/hf --max-shard-size 5GB \
        --dtype bfloat16

    # a Hugging Face folder (single file or sharded; or a .safetensors with config.json beside it) -> a DCP
    # seed checkpoint (or start training from the folder directly: --checkpoint.initial_load_path <folder>)
    python scripts/convert_checkpoint.py from-hf outputs/debug/hf outputs/finetune/checkpoint/step-0
    python train.py ... --checkpoint.initial_load_path outputs/finetune/checkpoint/step-0

Every model with a Hugging Face adapter converts (``--help`` lists them): its adapter renames and re-lays the
weights (Llama's q/k projections, for one, are permuted between our interleaved-pair RoPE layout and Hugging Face's
rotate-half layout, titanlike/models/llama/hf.py), so either side computes the same logits. Runs in one process,
needs no process group, and never writes over an existing path. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.checkpoint import export_hf, resolve_step, write_seed_checkpoint  # noqa: E402
from titanlike.errors import ConfigError  # noqa: E402
from titanlike.hf import load_hf  # noqa: E402


def _models_line() -> str:
    """The registered models that convert (those with a Hugging Face adapter), for --help."""
    from titanlike.models import get_spec, registered

    names = [n for n in registered() if get_spec(n).hf_adapter]
    return f"Models that convert (a Hugging Face adapter each): {', '.join(names)}."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_models_line())
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="checkpoint -> Hugging Face folder (weights, config, tokenizer)")
    to_hf.add_argument("checkpoint", help="a step-N folder (DCP) written by titanlike, or a folder of them (newest)")
    to_hf.add_argument("out", help="new folder for the weights, config.json and the tokenizer's files")
    to_hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into model-0000i-of-0000n.safetensors + index above this (default 5GB)",
    )
    to_hf.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="cast the weights (default: as saved)"
    )
    to_hf.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer to write beside the weights, a name or folder (default: the one the checkpoint records)",
    )
    to_hf.add_argument("--no-tokenizer", action="store_true", help="write the weights and config only")
    from_hf = sub.add_parser("from-hf", help="Hugging Face weights -> DCP seed checkpoint")
    from_hf.add_argument("weights", help="model.safetensors (config.json beside it) or the folder holding both")
    from_hf.add_argument("out", help="new checkpoint folder, e.g. <dump>/checkpoint/step-0")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.direction == "to-hf":
            tokenizer = None
            if args.tokenizer:
                from titanlike.data import build_tokenizer

                try:
                    tokenizer = build_tokenizer(args.tokenizer)
                except ValueError as e:
                    raise ConfigError(f"--tokenizer: {e}") from None
            source = resolve_step(args.checkpoint)
            out = export_hf(
                source,
                args.out,
                max_shard_size=args.max_shard_size,
                dtype=getattr(torch, args.dtype) if args.dtype else None,
                tokenizer=tokenizer,
                with_tokenizer=not args.no_tokenizer,
            )
        else:
            state_dict, model_args = load_hf(args.weights)
            state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
            out = write_seed_checkpoint(state_dict, model_args, args.out, source=str(args.weights))
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    what = f" from {source}" if args.direction == "to-hf" else ""
    print(f"wrote {out}{what} in {time.perf_counter() - t0:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
