"""The allocations and copies of one training step, by bytes (torch.profiler with ``profile_memory``), on CPU.

    python scripts/step_copies.py                                   # the debug model (configs/debug_model.toml)
    python scripts/step_copies.py --model.name qwen3 --top 12       # any config key, as train.py takes them
    python scripts/step_copies.py --gqa repeat                      # side by side: k, v repeated to every head

One process, the plain model (no parallelism), float32: a first step allocates AdamW's state, then the second
(forward, loss, backward, AdamW step, zero_grad) is profiled. Prints the operators that allocate the most bytes
(the profiler's self CPU memory: what an operator allocated and did not free itself) and every copying operator
(copy_, clone, contiguous, cat, repeat_interleave, ...) with its bytes, calls and share of the step's allocations.
``--gqa repeat`` runs the attention seam as it was before SDPA's ``enable_gqa``: k and v repeated to every query
head first (a patch of the seam here, for the comparison; the model itself has no such option).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

COPIES = (
    "aten::copy_",
    "aten::clone",
    "aten::contiguous",
    "aten::cat",
    "aten::repeat_interleave",
    "aten::repeat",
    "aten::_to_copy",
    "aten::index_select",
    "aten::stack",
)
MiB = 2**20


@contextlib.contextmanager
def _repeat_kv_seam():
    """AttentionCore.forward with k and v repeated to every query head before the attention (the former path)."""
    from titanlike.models.decoder import AttentionCore

    real = AttentionCore.forward

    def forward(self, q, k, v, mask=None, sinks=None):
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        return real(self, q, k, v, mask, sinks)

    AttentionCore.forward = forward
    try:
        yield
    finally:
        AttentionCore.forward = real


def profile_step(argv: list[str], gqa: str = "sdpa"):
    from titanlike.config import load_config, model_args_from_config
    from titanlike.data import build_tokenizer
    from titanlike.loss import cross_entropy_loss
    from titanlike.models import get_spec
    from titanlike.training.optim import build_optimizer

    if not any(a.startswith("--job.config_file") for a in argv):
        argv = ["--job.config_file", str(Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"), *argv]
    cfg = load_config(argv, world_size=1)
    args = model_args_from_config(cfg, build_tokenizer(cfg.model.tokenizer).vocab_size)
    torch.manual_seed(0)
    model = get_spec(cfg.model.name).build(args)
    model.init_weights()
    optimizer = build_optimizer([model], cfg)
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    tokens = torch.randint(0, args.vocab_size, (b, s + 1))

    def step():
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with _repeat_kv_seam() if gqa == "repeat" else contextlib.nullcontext():
        step()  # AdamW's state
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    return cfg, args, prof.key_averages()


def report(cfg, args, events, top: int, gqa: str) -> str:
    total = sum(max(e.self_cpu_memory_usage, 0) for e in events)
    lines = [
        f"one step of {cfg.model.name}/{cfg.model.flavor} ({args.n_layers} layers, dim {args.dim}, {args.n_heads} "
        f"heads / {args.n_kv_heads} kv), batch {cfg.training.local_batch_size} x {cfg.training.seq_len}, "
        f"float32, CPU, attention {'k/v repeated' if gqa == 'repeat' else 'enable_gqa'}: "
        f"{total / MiB:.2f} MiB allocated by operators",
        "",
        f"top {top} allocating operators (self CPU memory):",
        f"  {'operator':<44}{'MiB':>9}{'calls':>7}",
    ]
    for e in sorted(events, key=lambda e: -e.self_cpu_memory_usage)[:top]:
        lines.append(f"  {e.key:<44}{e.self_cpu_memory_usage / MiB:>9.2f}{e.count:>7}")
    lines += [
        "",
        "copies (CPU memory incl. the ops they call):",
        f"  {'operator':<44}{'MiB':>9}{'calls':>7}{'share':>8}",
    ]
    copies = sorted((e for e in events if e.key in COPIES), key=lambda e: -e.cpu_memory_usage)
    for e in copies:
        lines.append(
            f"  {e.key:<44}{e.cpu_memory_usage / MiB:>9.2f}{e.count:>7}{e.cpu_memory_usage / max(total, 1):>8.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=10, help="how many allocating operators to list")
    ap.add_argument("--gqa", choices=("sdpa", "repeat"), default="sdpa", help="repeat: the former k/v repeat")
    a, rest = ap.parse_known_args(argv)
    cfg, args, events = profile_step(rest, a.gqa)
    print(report(cfg, args, events, a.top, a.gqa))
    return 0


if __name__ == "__main__":
    sys.exit(main())
