"""Peak memory of the cross entropy, chunked vs unchunked, forward + backward, for a large-vocabulary head.

    python scripts/loss_memory.py                      # 2048 tokens x 128256 vocab, bf16 logits, CPU, fake
    python scripts/loss_memory.py --real               # the same with real tensors (about 4 GiB at the peak)
    python scripts/loss_memory.py --device cuda --real # torch.cuda.max_memory_allocated

The logits are a leaf tensor (as if produced by the output head); the peak counts them and their gradient.
On CPU the peak comes from ``torch.distributed._tools.mem_tracker.MemTracker``; by default the tensors are
fake (``FakeTensorMode``): the tracker sees every allocation with its real size but nothing is allocated, so
the 128k-vocabulary case costs no memory. ``--real`` allocates for real (the numbers agree with fake mode).
On CUDA, ``torch.cuda.max_memory_allocated`` of real tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titanlike.loss import cross_entropy_loss  # noqa: E402

MiB = 2**20


def peak_bytes(
    tokens: int,
    vocab: int,
    chunk_size: int | None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    fake: bool = True,
) -> int:
    """Forward + backward peak bytes of ``cross_entropy_loss`` on (tokens, vocab) logits, logits included."""
    if device == "cuda":
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - logits.numel() * logits.element_size() - labels.numel() * 8
        cross_entropy_loss(logits, labels, chunk_size=chunk_size).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode() if fake else contextlib.nullcontext():
        logits = torch.randn(tokens, vocab, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        tracker = MemTracker()
        with tracker:
            cross_entropy_loss(logits, labels, chunk_size=chunk_size).backward()
    return tracker.get_tracker_snapshot("peak")[logits.device]["Total"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--chunks", default="none,1024,256,64", help="comma-separated; 'none' = unchunked")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--real", action="store_true", help="allocate real tensors on CPU (default: fake)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    chunks = [None if c.strip() == "none" else int(c) for c in args.chunks.split(",")]
    logits_mib = args.tokens * args.vocab * dtype.itemsize / MiB
    mode = (
        "cuda max_memory_allocated"
        if args.device == "cuda"
        else ("MemTracker, real tensors" if args.real else "MemTracker, fake tensors")
    )
    print(
        f"cross entropy fwd+bwd peak: {args.tokens} tokens x {args.vocab} vocab, {args.dtype} logits "
        f"({logits_mib:.0f} MiB), {mode}"
    )
    print(f"{'chunk_size':>10}  {'peak MiB':>9}  {'x logits':>8}")
    for chunk in chunks:
        peak = peak_bytes(args.tokens, args.vocab, chunk, dtype, args.device, fake=not args.real)
        print(f"{str(chunk or 'none'):>10}  {peak / MiB:9.0f}  {peak / MiB / logits_mib:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
