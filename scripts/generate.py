"""Sample text from a titanlike checkpoint (any layout) or a Hugging Face folder.

    python scripts/generate.py --checkpoint outputs/debug/checkpoint --prompt "ROMEO:"            # greedy, newest step
    python scripts/generate.py --checkpoint outputs/debug/hf --prompt "ROMEO:" --prompt "JULIET:" \
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --max-new-tokens 100
    python scripts/generate.py --checkpoint outputs/debug/checkpoint/step-200 --prompt-file prompts.txt
    torchrun --nproc_per_node=2 scripts/generate.py --checkpoint outputs/8b/checkpoint --prompt "Hi"  # tensor parallel

The tokenizer is the one the checkpoint recorded (checkpoint.json), or the Hugging Face folder's tokenizer.json, or
``--tokenizer``. A row stops at the tokenizer's EOS (``--ignore-eos``: never, and each EOS generated is printed as
its text). Each prompt prints under a ``--- prompt i ---`` line and its continuation under a ``--- continuation ---``
line (how many tokens, whether EOS ended it), so where the model's text starts is never in doubt; ``--plain``: the
prompt and continuation as one text. Under ``torchrun`` every rank holds its tensor-parallel shards (the model's own
sharding entries) and rank 0 prints. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.errors import ConfigError  # noqa: E402
from titanlike.generate import Sampling, cache_blockers, generate, load_model  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint", required=True, help="a step-N folder, a checkpoint folder (its newest step) or a HF folder"
    )
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable: one batch)")
    ap.add_argument("--prompt-file", default=None, help="a text file, one prompt per non-empty line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="tokenizer name or folder (default: the checkpoint's)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    ap.add_argument("--bos", action="store_true", help="start every prompt with the tokenizer's BOS token")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (its text is printed)")
    ap.add_argument("--plain", action="store_true", help="print prompt + continuation as one text, no headers")
    ap.add_argument("--no-cache", action="store_true", help="recompute the sequence every step (no KV cache)")
    return ap.parse_args(argv)


def read_prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompt)
    if a.prompt_file:
        path = Path(a.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file '{path}' does not exist")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("give a prompt: --prompt TEXT or --prompt-file FILE")
    return prompts


def tokenizer_for(a: argparse.Namespace, loaded):
    from titanlike.checkpoint import recorded_tokenizer
    from titanlike.data import build_tokenizer

    name = a.tokenizer or recorded_tokenizer(loaded.meta)
    if name is None and loaded.kind == "hf" and (loaded.path / "tokenizer.json").is_file():
        name = str(loaded.path)
    if name is None:
        raise ConfigError(f"'{a.checkpoint}' records no tokenizer; pass --tokenizer <name or folder>")
    try:
        return build_tokenizer(name)
    except ValueError as e:
        raise ConfigError(f"tokenizer: {e}; pass --tokenizer <name or folder>") from None


def _tp_mesh(device: torch.device):
    """The tensor-parallel mesh over every rank under torchrun (None in one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))


class Result(NamedTuple):
    """One prompt's outcome: its continuation as text (an EOS that ended it left out, any other kept as its text),
    how many tokens were generated and whether EOS ended it."""

    prompt: str
    continuation: str
    tokens: int
    ended_at_eos: bool

    def show(self, i: int, plain: bool) -> str:
        if plain:
            return self.prompt + self.continuation
        why = "ended at EOS" if self.ended_at_eos else "no EOS"
        return (
            f"--- prompt {i} ---\n{self.prompt}\n--- continuation ({self.tokens} tokens, {why}) ---\n"
            f"{self.continuation}"
        )


def run(a: argparse.Namespace) -> list[Result]:
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)
    problems = sampling.problems() + ([] if a.max_new_tokens >= 1 else ["--max-new-tokens must be at least 1"])
    if problems:
        raise ConfigError("; ".join(problems))
    prompts = read_prompts(a)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    loaded = load_model(a.checkpoint, dtype=getattr(torch, a.dtype), device=device, tp_mesh=_tp_mesh(device))
    tok = tokenizer_for(a, loaded)
    blockers = cache_blockers(loaded.model)
    if blockers and not a.no_cache and _rank() == 0:
        print(f"note: no KV cache ({'; '.join(blockers)}): every step recomputes the sequence", file=sys.stderr)
    ids = [tok.encode(p, bos=a.bos and tok.bos_id is not None) for p in prompts]
    new = generate(
        loaded.model,
        ids,
        a.max_new_tokens,
        sampling=sampling,
        eos_id=None if a.ignore_eos else tok.eos_id,
        vocab_size=tok.vocab_size,
        use_cache=not a.no_cache,
    )
    out = []
    for p, row in zip(prompts, new):
        ended = not a.ignore_eos and bool(row) and row[-1] == tok.eos_id
        out.append(Result(p, tok.decode(row[:-1] if ended else row), len(row), ended))
    return out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        texts = run(a)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if _rank() == 0:
        for i, result in enumerate(texts, 1):
            print(result.show(i, a.plain), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
