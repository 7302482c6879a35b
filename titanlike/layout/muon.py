"""Muon's decisions, as plain data: which rank orthogonalizes which matrix, how the matrices are batched, what it
costs, and the rules a Muon configuration must satisfy. The optimizer (``titanlike.parallel.muon``) acts on them,
the planner prices them.

* **Owners.** Every matrix (a fused projection's chunk, an expert's matrix) is orthogonalized once per step by one
  *owner*: the ranks of the matrix's mesh (its data-parallel x tensor-parallel ranks; a pipeline stage's own) take
  the matrices of the optimizer's order in turn, round-robin (:func:`plan_buckets`), so the Newton-Schulz work is
  divided by the mesh size, not repeated on every rank.
* **Buckets.** Consecutive matrices of one mesh share one all-to-all that gathers every owner's matrices and one
  that scatters the results back: two collectives per bucket. A bucket holds at least one matrix per rank (so every
  owner works at once: a bucket of fewer matrices than ranks would leave ranks idle while the owners compute, one
  bucket after the other) and is extended until it holds ``bucket_bytes`` of full matrices (in the Newton-Schulz
  dtype). An owner holds its matrices of one bucket at a time: about ``max(1 matrix, bucket_bytes / ranks)``.
* **Cost.** Newton-Schulz on an ``m x n`` matrix (``a = min(m, n)``, ``b = max(m, n)``) costs, per iteration, the
  Gram matrix ``X X^T`` (``2 a^2 b``), its quadratic ``A A`` (``2 a^3``) and the update ``B X`` (``2 a^2 b``):
  :func:`ns_flops`.
* **Learning rate.** torch.optim.Muon's adjustment by the matrix's shape (:func:`lr_ratio`): ``original``
  (Keller Jordan's ``sqrt(max(1, rows / cols))``) or ``match_rms_adamw`` (Moonshot's ``0.2 sqrt(max(rows, cols))``,
  so AdamW's learning rate and weight decay carry over).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ADJUST_LR_FNS", "MUON_ONLY_KEYS", "Bucket", "lr_ratio", "muon_violations", "ns_flops", "plan_buckets"]

ADJUST_LR_FNS = ("original", "match_rms_adamw")
# The [optimizer] keys only Muon reads: set under optimizer.name = "AdamW" they would change nothing.
MUON_ONLY_KEYS = (
    "momentum",
    "nesterov",
    "ns_coefficients",
    "ns_steps",
    "muon_eps",
    "adjust_lr_fn",
    "ns_dtype",
    "adamw_lr",
    "adamw_weight_decay",
    "muon_bucket_mb",
)


def lr_ratio(adjust_lr_fn: str, rows: int, cols: int) -> float:
    """The factor torch.optim.Muon multiplies the learning rate by for a ``rows x cols`` matrix."""
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on a ``rows x cols`` matrix (module docstring)."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a**3)


@dataclass(frozen=True)
class Bucket:
    items: tuple[int, ...]  # indices into the matrix list, in order
    owners: tuple[int, ...]  # the owner (rank in the mesh's group) of each


def plan_buckets(sizes: Sequence[int], group_size: int, bucket_bytes: float) -> list[Bucket]:
    """The buckets of a mesh's matrices (``sizes``: each one's full bytes, in the optimizer's order): consecutive
    matrices until a bucket holds ``group_size`` of them and ``bucket_bytes``, the ``k``-th matrix owned by rank
    ``k mod group_size`` of the group."""
    buckets, current, filled = [], [], 0
    for k, size in enumerate(sizes):
        current.append(k)
        filled += size
        if len(current) >= group_size and filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return [Bucket(tuple(b), tuple(k % group_size for k in b)) for b in buckets]


def muon_violations(cfg, muon_patterns: Sequence[str], model: str) -> list[str]:
    """The Muon rules: Muon-only keys changed under AdamW, three Newton-Schulz coefficients, a model whose sharding
    entries give Muon matrices (``muon_patterns``, of model ``model``)."""
    o, out = cfg.optimizer, []
    defaults = type(o)()
    if o.name != "Muon":
        changed = [f"optimizer.{k}" for k in MUON_ONLY_KEYS if getattr(o, k) != getattr(defaults, k)]
        if changed:
            out.append(
                f"{', '.join(changed)} set but optimizer.name is {o.name!r} (only Muon reads "
                f"{'them' if len(changed) > 1 else 'it'}); set optimizer.name = 'Muon' or drop "
                f"{'them' if len(changed) > 1 else 'it'}"
            )
        return out
    if len(o.ns_coefficients) != 3:
        out.append(
            f"optimizer.ns_coefficients: Newton-Schulz takes 3 coefficients (a, b, c), got {len(o.ns_coefficients)}; "
            f"torch's are {', '.join(str(c) for c in defaults.ns_coefficients)}"
        )
    if not muon_patterns:
        out.append(
            f"optimizer.name = 'Muon': {model}'s sharding entries mark no matrix for Muon (Colwise / Rowwise / "
            f"FusedColwise entries with muon=True); use optimizer.name = 'AdamW' for {model}"
        )
    return out
