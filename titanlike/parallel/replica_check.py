"""The ``Replicate`` assumption checked, not trusted: a style that takes a plain tensor for an identical replica on
every tp rank (:class:`~titanlike.parallel.tensor_parallel.ReplicateParallel`, ``PositionEmbeddingParallel``,
:class:`~titanlike.parallel.fused.FusedColwiseParallel`) compares that input and the module's replicated parameters
across the mesh, by a hash, not the tensors.

The hash of a tensor is five float64 numbers (numel, sum |x|, sum x, sum x^2, the sum over its even
positions): reductions over the tensor (no float64 copy of it), then ONE all-reduce (MAX) of ``[h, -h]`` over
each mesh dim, which gives every rank the largest and the smallest value of each number. Replicas are bitwise
equal (the same bytes from the all-reduce or broadcast that made them), so any difference above 1e-7 relative is
not rounding: a refusal, the same one-line error on every rank, naming the module and the style it needs.
``check``:

* ``"first"`` (default): the plain input of the module's first forward, with the module's replicated parameters
  in the same all-reduce (a mis-plan shows at step 1: issue 26's per-head norms); a DTensor input is not taken on
  trust, so it costs nothing (the trainer's own models pass DTensors; their parameters are equal at the first
  step by construction: ``distribute_tensor`` broadcasts);
* ``"always"``: the plain input and the replicated parameters' local tensors at every forward (debugging: also
  catches replicated parameters drifting apart, e.g. a gradient that a rank computed from its own part and nobody
  summed);
* ``"never"``: trusted, no communication.

Inside ``torch.compile`` the check is skipped (a data-dependent collective would break the graph); the eager first
step of a compiled model runs it before tracing only when the module runs eagerly. Cost: measured in
docs/parallelizing_your_own_module.md ("What the replica check costs").
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = [
    "CHECKS",
    "FINGERPRINT",
    "ReplicaCheck",
    "checks_paused",
    "disagreeing",
    "fingerprint",
    "gathered",
    "name_checks",
]

CHECKS = ("first", "always", "never")
RTOL = 1e-7
_PAUSED = [0]


@contextlib.contextmanager
def checks_paused():
    """Forwards whose inputs are not the step's data skip the check (and leave ``"first"`` for the real first step):
    a pipeline stage's metadata inference, which torch >= 2.13 runs on ``torch.empty`` tensors, different on every
    rank."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def _hash(t: torch.Tensor) -> torch.Tensor:
    """numel, sum |x|, sum x, sum x^2 and the sum over the even positions, in float64, with no float64 copy of the
    tensor (reductions with ``dtype=``; the even positions are a strided view)."""
    flat = t.detach().reshape(-1)
    f64 = torch.float64
    if not flat.is_floating_point():  # position ids, token ids: small
        flat = flat.to(f64)
    return torch.stack(
        [
            torch.tensor(float(flat.numel()), dtype=f64, device=flat.device),
            torch.linalg.vector_norm(flat, 1, dtype=f64),
            flat.sum(dtype=f64),
            torch.linalg.vector_norm(flat, 2, dtype=f64) ** 2,
            flat[::2].sum(dtype=f64),
        ]
    )


class ReplicaCheck:
    """The state of one module's check: its mode, its name (set by ``apply_tp``; the class name until then), what
    the refusal advises, and whether it has run."""

    def __init__(self, check: str, style: str, advice: str, *, parameters: bool = True):
        if check not in CHECKS:
            raise ValueError(f"{style}: check must be one of {CHECKS}, got {check!r}")
        self.check, self.style, self.advice, self.parameters = check, style, advice, parameters
        self.name: str | None = None
        self.done = False

    def __call__(self, module: nn.Module, x, device_mesh: DeviceMesh) -> None:
        """Compare the plain input ``x`` (None: a DTensor input, nothing to take on trust) and ``module``'s
        replicated parameters across ``device_mesh``; raise on a difference."""
        if self.check == "never" or (self.check == "first" and self.done) or torch.compiler.is_compiling():
            return
        if _PAUSED[0]:
            return
        self.done = True
        named = [] if not isinstance(x, torch.Tensor) else [("input", x)]
        # the parameters ride along with a plain input (the same all-reduce); alone only under "always" (at the
        # first step they are equal by construction: distribute_tensor broadcasts), so DTensor inputs cost nothing
        if self.parameters and (named or self.check == "always"):
            named += [
                (f"parameter '{n}'", p.to_local() if isinstance(p, DTensor) else p)
                for n, p in module.named_parameters(recurse=False)
            ]
        if not named:
            return
        with torch.no_grad():
            h = torch.stack([_hash(t) for _, t in named])
            both = torch.cat([h, -h])
            for dim in range(device_mesh.ndim):
                group = device_mesh.get_group(dim)
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            hi, lo = both[: len(named)], -both[len(named) :]
            differs = ((hi - lo).abs() > RTOL * (hi.abs() + lo.abs())).any(dim=1).tolist()
        bad = [what for (what, _), d in zip(named, differs) if d]
        if bad:
            name = self.name or type(module).__name__
            raise RuntimeError(
                f"{self.style} on '{name}' ({type(module).__name__}): its {' and '.join(bad)} "
                f"{'differs' if len(bad) == 1 else 'differ'} across the "
                f"{device_mesh.size()} ranks of {device_mesh}, so it is not a replica; {self.advice}"
            )


def name_checks(model: nn.Module) -> None:
    """Give every module's replica check its module path (``apply_tp`` calls this after the plan)."""
    for name, module in model.named_modules():
        check = getattr(module, "_titanlike_replica_check", None)
        if check is not None:
            check.name = name or "<root>"


FINGERPRINT = 5  # int64 numbers per tensor in :func:`fingerprint`


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Five int64 numbers that are equal for bitwise-equal tensors and differ when any single bit differs: the
    number of elements; the sums of the tensor's bytes read as int64 words (wrapping sums: exact modulo 2**64, so a
    flipped bit, which changes one word by 2**k, always changes them) over all words, the first half and the last
    two thirds; and the bits of its 2-norm (two flips that cancel in the word sums rarely cancel there too). No
    copy of a contiguous tensor: reductions over a view of its bytes, each at memory speed (an int64 sum reads at
    4.4 GB/s on one CPU core here; the same sum over int32 words widened to int64, 0.3)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    i64 = torch.int64
    if flat.numel() * flat.element_size() % 8 == 0:
        raw = flat.view(torch.uint8)
        if raw.storage_offset() % 8:  # a view that starts between two words: int64 words of a copy
            raw = raw.clone()
        words = raw.view(i64)
    else:  # a small odd-sized tensor: one word per element
        words = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[flat.element_size()]).to(i64)
    n = words.numel()
    norm = torch.linalg.vector_norm(flat if flat.is_floating_point() else flat.to(torch.float64))
    return torch.stack(
        [
            torch.tensor(flat.numel(), dtype=i64, device=flat.device),
            words.sum(),
            words[: n // 2].sum(),
            words[n // 3 :].sum(),
            norm.to(torch.float64).reshape(1).view(i64)[0],
        ]
    )


def disagreeing(rows: torch.Tensor, group) -> list[bool]:
    """``rows`` (n x FINGERPRINT int64, this rank's fingerprints of n tensors, the same n tensors on every member
    of ``group``): whether each tensor differs anywhere in the group. One all-reduce (MAX) of ``[rows, ~rows]``
    (``~`` is exact: no overflow, unlike negation), which gives every member the largest and the smallest value of
    each number."""
    both = torch.cat([rows, ~rows])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = rows.shape[0]
    hi, lo = both[:n], ~both[n:]
    return (hi != lo).any(dim=1).tolist()


def gathered(rows: torch.Tensor, group, slot: int, size: int, allreduce=None) -> torch.Tensor:
    """Every member's ``rows`` (size x n x FINGERPRINT): each member writes its own into slot ``slot`` of zeros and
    one all-reduce (SUM, exact in int64) fills the rest; ``allreduce(tensor)`` replaces ``dist.all_reduce`` where the
    group is not a torch process group (torchft's manager)."""
    out = torch.zeros((size, *rows.shape), dtype=torch.int64, device=rows.device)
    out[slot] = rows
    if allreduce is not None:
        allreduce(out)
    else:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
