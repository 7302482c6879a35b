"""Document masking's speed: block_causal against causal attention on the same batch, side by side in one run, and
the share of attention the block-causal mask skips on the shipped corpus.

    python scripts/mask_bench.py                          # CPU: the exact path (SDPA with a boolean mask)
    python scripts/mask_bench.py --device cuda            # GPU: FlexAttention with a block mask (compiled), bf16
    python scripts/mask_bench.py --seq-len 256 --batch 1 --heads 2 --head-dim 16 --steps 1 --warmup 0   # smoke

Both rows run the shared attention seam (``titanlike.models.decoder.AttentionCore``) on the same q, k, v
(``--batch`` x ``--seq-len`` tokens, ``--heads`` heads, grouped kv heads), forward + backward per step:

* ``causal``: no mask (SDPA's causal kernel);
* ``block_causal``: the ``DocumentMask`` of the batch (built every step, as every forward does: its time counts),
  documents of the shipped corpus's kind cut at ``--doc-len`` tokens on average (exponential lengths, seeded);
* ``window``: a sliding window of ``--window`` positions (gpt-oss: 128), causal otherwise
  (``AttentionCore(window=...)`` with the forward's causal ``DocumentMask``; the row's kept share of the causal pairs
  printed beside it: the fraction of the scores a block-sparse kernel computes);
* ``window_sinks``: the same with a learned sink per head (CPU: the exact explicit softmax; CUDA: FlexAttention's
  log-sum-exp).

The rows alternate step by step (``--steps`` timed of each after ``--warmup``), so drifting load on a shared machine
hits both alike. Printed: ms per step of each row, the ratio block_causal / causal, the batch's kept share of the
causal pairs and tiles, and the shipped corpus's document statistics at ``--seq-len``
(``titanlike.data.documents.document_stats``: the fraction of attention FLOPs the mask skips there; ``--no-corpus``
leaves it out). ``--json PATH`` writes the same as JSON. Timings on a shared CPU are noise; a GPU number comes from a
GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titanlike.models.decoder import AttentionCore  # noqa: E402
from titanlike.models.masking import DocumentMask, attention_backend, document_starts  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULTS = {"cpu": (2, 1024, 8, 2, 64, "float32"), "cuda": (4, 8192, 32, 8, 128, "bfloat16")}  # b, s, h, kv, d


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--doc-len", type=float, default=512.0, help="mean document length of the timed batch")
    ap.add_argument("--window", type=int, default=128, help="the sliding window of the window rows")
    ap.add_argument("--block", type=int, default=128, help="FlexAttention's tile for the block fraction")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-corpus", action="store_true", help="skip the shipped corpus's statistics")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    b, s, h, kv, d, dtype = DEFAULTS[a.device]
    a.batch, a.seq_len, a.heads = a.batch or b, a.seq_len or s, a.heads or h
    a.kv_heads, a.head_dim, a.dtype = a.kv_heads or min(kv, a.heads), a.head_dim or d, a.dtype or dtype
    if a.heads % a.kv_heads:
        ap.error(f"--heads {a.heads} is not divisible by --kv-heads {a.kv_heads}")
    return a


def packed_tokens(batch: int, seq_len: int, doc_len: float, seed: int, eos: int = 0) -> torch.Tensor:
    """Token ids with an EOS after documents of exponential length (mean ``doc_len``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.ones(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        p = int(torch.empty(1).exponential_(1 / doc_len, generator=g).item())  # the window starts inside one
        while p < seq_len:
            x[row, p] = eos
            p += 1 + int(torch.empty(1).exponential_(1 / doc_len, generator=g).item())
    return x


def corpus_stats(seq_len: int, block: int):
    from titanlike.data import build_tokenizer, load_token_stream, shipped_corpus
    from titanlike.data.documents import document_stats

    tok = build_tokenizer("test")
    return document_stats(load_token_stream(shipped_corpus(), tok), tok.eos_id, seq_len, block)


def main(argv=None) -> dict:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), DTYPES[a.dtype]
    g = torch.Generator().manual_seed(a.seed)
    shapes = [(a.batch, a.seq_len, n, a.head_dim) for n in (a.heads, a.kv_heads, a.kv_heads)]
    q, k, v = (torch.randn(*s, generator=g).to(dev, dtype).requires_grad_() for s in shapes)
    starts = document_starts(packed_tokens(a.batch, a.seq_len, a.doc_len, a.seed), 0).to(dev)
    cores = {"window": AttentionCore(window=a.window), "window_sinks": AttentionCore(window=a.window, sinks=True)}
    sinks = torch.zeros(a.heads, device=dev, dtype=dtype).requires_grad_()
    positions = torch.arange(a.seq_len, device=dev)

    def step(name: str) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name in cores:
            mask = DocumentMask.causal(a.batch, positions, (a.window,))
            out = cores[name](q, k, v, mask, sinks=sinks if name == "window_sinks" else None)
        else:
            out = AttentionCore()(q, k, v, DocumentMask(starts, positions) if name == "block_causal" else None)
        out.float().square().mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"causal": [], "block_causal": [], "window": [], "window_sinks": []}
    for i in range(a.warmup + a.steps):
        for name in times:
            t = step(name)
            if i >= a.warmup:
                times[name].append(t)
    ms = {name: 1e3 * sum(t) / len(t) for name, t in times.items()}
    dense = DocumentMask(starts.cpu(), positions.cpu(), backend="sdpa").dense(0, a.seq_len, a.seq_len)
    causal_pairs = a.batch * a.seq_len * (a.seq_len + 1) / 2
    pairs = dense.sum().item() / causal_pairs
    windowed = DocumentMask.causal(1, positions.cpu(), backend="sdpa").dense(0, a.seq_len, a.seq_len, a.window)
    window_pairs = a.batch * windowed.sum().item() / causal_pairs
    result = {
        "args": vars(a),
        "backend": attention_backend(dev),
        "ms_per_step": ms,
        "ratio_block_causal_over_causal": ms["block_causal"] / ms["causal"],
        "batch_pair_fraction": pairs,
        "ratio_window_over_causal": ms["window"] / ms["causal"],
        "ratio_window_sinks_over_causal": ms["window_sinks"] / ms["causal"],
        "window_pair_fraction": window_pairs,
        "corpus": None,
    }
    print(f"attention fwd+bwd, {a.batch} x {a.seq_len} tokens, {a.heads}/{a.kv_heads} heads of {a.head_dim}, {a.dtype}")
    print(f"  causal        {ms['causal']:9.2f} ms/step")
    print(f"  block_causal  {ms['block_causal']:9.2f} ms/step ({result['backend']}; the batch keeps {pairs:.4f} of")
    print(f"                the causal pairs, mean document {a.doc_len:.0f} tokens)")
    print(f"  ratio block_causal / causal: {result['ratio_block_causal_over_causal']:.3f}")
    print(f"  window {a.window:<6d}  {ms['window']:9.2f} ms/step (keeps {window_pairs:.4f} of the causal pairs); ratio")
    print(f"                {result['ratio_window_over_causal']:.3f}; with sinks {ms['window_sinks']:9.2f} ms/step")
    print(f"                (ratio {result['ratio_window_sinks_over_causal']:.3f})")
    if not a.no_corpus:
        st = corpus_stats(a.seq_len, a.block)
        result["corpus"] = {**vars(st), "flops_skipped": 1 - st.pair_fraction}
        print(f"shipped corpus: {st.describe()}")
        print(f"  attention FLOPs skipped by block_causal at seq_len {a.seq_len}: {1 - st.pair_fraction:.4%}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
