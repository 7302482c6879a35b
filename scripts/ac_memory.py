"""Peak memory of one forward + backward per activation-checkpointing mode, without allocating anything.

    python scripts/ac_memory.py --flavor 1B --batch 1 --seq-len 2048

The model (bf16 parameters by default) is built and run under ``FakeTensorMode``: tensors have real shapes and
sizes but no storage, and ``torch.distributed._tools.mem_tracker.MemTracker`` records what would be alive
at the peak, by kind (parameters, activations, temporaries). So a 1B or 8B model's activation memory is
measured on a laptop. Gradients are not part of the peak here (it falls in the forward/early backward); the
optimizer is not run. Single device, no parallelism.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titanlike.config import ActivationCheckpoint  # noqa: E402
from titanlike.models.llama import FLAVORS, Transformer  # noqa: E402
from titanlike.parallel.activation_checkpoint import apply_ac  # noqa: E402

GiB = 2**30
MODES = {"none": ("none", "op"), "full": ("full", "op"), "op": ("selective", "op"), "every2": ("selective", "2")}


def peak_by_kind(
    flavor: str, batch: int, seq_len: int, mode: str, dtype: torch.dtype = torch.bfloat16, vocab: int = 128256
) -> dict[str, int]:
    """{"Parameter": bytes, "Activation": ..., "Temp": ..., "Total": ...} at the fwd+bwd peak for ``mode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    args = FLAVORS[flavor]
    args = args.replace(
        vocab_size=args.vocab_size if args.vocab_size > 0 else vocab, max_seq_len=max(args.max_seq_len, seq_len)
    )
    ac_mode, option = MODES[mode]
    prev = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)
        try:
            model = Transformer(args)
        finally:
            torch.set_default_dtype(prev)
        apply_ac(model, ActivationCheckpoint(mode=ac_mode, selective_ac_option=option))
        tokens = torch.randint(0, args.vocab_size, (batch, seq_len))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(tokens).float().logsumexp(-1).sum().backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {getattr(k, "value", k): v for k, v in peak.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args(argv)
    print(
        f"fwd+bwd peak by AC mode: flavor={a.flavor} batch={a.batch} seq={a.seq_len} {a.dtype} parameters "
        f"(fake tensors, MemTracker)"
    )
    print(f"{'mode':>7} {'params GiB':>11} {'activations GiB':>16} {'temp GiB':>9} {'total GiB':>10}")
    for mode in a.modes.split(","):
        p = peak_by_kind(a.flavor, a.batch, a.seq_len, mode, getattr(torch, a.dtype))
        print(
            f"{mode:>7} {p.get('Parameter', 0) / GiB:11.2f} {p.get('Activation', 0) / GiB:16.2f} "
            f"{p.get('Temp', 0) / GiB:9.2f} {p['Total'] / GiB:10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
