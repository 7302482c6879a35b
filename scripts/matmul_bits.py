"""What the CPU matmul does to the bits of a row / column when only M, only N or K of the problem changes.

    OMP_NUM_THREADS=2 python scripts/matmul_bits.py            # float32 and bfloat16, 1 and 2 threads

``C = F.linear(A, W)`` (A: M x K tokens, W: N x K, what every projection runs). For each dtype, thread count and
(K, N) it reports:

* **M**: which row counts m give rows that differ when computed alone (``A[:m]``, and ``A[m:2m]``) from the same
  rows of the full product (what a token split — cp, SP, another microbatch size — needs: the same bits per row
  whatever the other rows);
* **N**: which column counts differ when computed alone (``W[:n]``, ``W[n:2n]``): colwise tp;
* **K**: whether the products of the two K halves summed equal the full product (rowwise tp, or a weight gradient
  whose K is the tokens: cp, micro-batches);
* whether the full product is the same under both thread counts.

Nothing is asserted: the table is the measurement (docs/layout_invariance.md records it).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

ROWS = 1024  # M of the full product
SHAPES = [(64, 64), (200, 100), (256, 176), (256, 768), (512, 512), (64, 2048)]  # (K, N)
MS = (1, 2, 4, 8, 15, 16, 17, 32, 64, 100, 128, 256, 341, 512)  # row counts computed alone
NS = (1, 8, 16, 33, 64)  # column counts computed alone (and the same count from the middle)


def measure(dtype: torch.dtype, k: int, n: int, threads: int) -> dict:
    """For one (K, N): the M of ``MS`` whose rows computed alone differ from the full product's, the N of ``NS``
    whose columns (prefix or middle block) differ, whether two K halves summed give the full product, and the full
    product itself (compared across thread counts by the caller)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(k * 10_000 + n)
    a = torch.randn(ROWS, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)  # F.linear's weight (N x K)
    full = F.linear(a, w)
    m_bad = [m for m in MS if not torch.equal(F.linear(a[:m].contiguous(), w), full[:m])]
    m_mid = [m for m in MS if not torch.equal(F.linear(a[m : 2 * m].contiguous(), w), full[m : 2 * m])]
    n_bad = [c for c in NS if c < n and not torch.equal(F.linear(a, w[:c].contiguous()), full[:, :c])]
    n_mid = [
        c for c in NS if 2 * c <= n and not torch.equal(F.linear(a, w[c : 2 * c].contiguous()), full[:, c : 2 * c])
    ]
    h = k // 2
    halves = F.linear(a[:, :h].contiguous(), w[:, :h].contiguous()) + F.linear(
        a[:, h:].contiguous(), w[:, h:].contiguous()
    )
    return {
        "m": sorted(set(m_bad) | set(m_mid)),
        "n": sorted(set(n_bad) | set(n_mid)),
        "k_halves": torch.equal(halves.to(dtype), full),
        "full": full,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="two comma-separated thread counts (torch.set_num_threads)")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    blas = torch.__config__.show()
    lib = next((w for w in ("mkl", "openblas", "blis", "accelerate") if w in blas.lower()), "unknown")
    print(f"torch {torch.__version__}, BLAS {lib}, oneDNN {torch.backends.mkldnn.is_available()}; F.linear, M = {ROWS}")
    print(f"rows computed alone: M in {MS} (prefix and a block from the middle); columns: N in {NS}")
    print("| dtype | threads | K x N | M whose rows differ | N whose columns differ | K halves summed = full |")
    print("| --- | --- | --- | --- | --- | --- |")
    across = []
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in SHAPES:
            fulls = []
            for t in threads:
                r = measure(dtype, k, n, t)
                fulls.append(r["full"])
                name = str(dtype).removeprefix("torch.")
                m = ", ".join(map(str, r["m"])) or "none"
                nn = ", ".join(map(str, r["n"])) or "none"
                print(f"| {name} | {t} | {k} x {n} | {m} | {nn} | {'yes' if r['k_halves'] else 'no'} |", flush=True)
            across.append(all(torch.equal(fulls[0], f) for f in fulls[1:]))
    print(f"full products equal across thread counts {threads}: {sum(across)}/{len(across)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
