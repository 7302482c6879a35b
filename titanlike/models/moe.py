"""A mixture-of-experts feed-forward block in plain single-device ``torch.nn`` (no ``torch.distributed``).

``MoE(args)`` maps ``(batch, seq, dim) -> (batch, seq, dim)`` like a dense SwiGLU, so it drops into a decoder block
where the ``FeedForward`` was. Parallelism is applied from outside (expert parallelism:
``titanlike.parallel.expert_parallel``); the block only offers the swap points that needs.

**Routing** (:class:`Router`, DeepSeek-V3 / Qwen3-MoE style): ``scores = softmax(x Wg)`` or ``sigmoid(x Wg)`` over the
``num_experts`` experts, computed in at least float32; each token picks ``top_k`` experts by ``scores +
expert_bias`` (the bias, when load balancing is on, steers the *selection only*); optionally only inside the
``topk_groups`` best of ``num_groups`` expert groups (a group's score is the sum of its two best biased scores, as in
DeepSeek-V3); the routing weights are the unbiased scores of the picked experts, optionally renormalised to sum to 1
(``route_norm``), times ``route_scale``.

**Experts** (:class:`GroupedExperts`): SwiGLU experts stored as stacked 3-D weights, experts on dim 0, each
projection one ``nn.Parameter``: ``w1``, ``w3`` of shape ``(num_experts, hidden_dim, dim)`` and ``w2`` of shape
``(num_experts, dim, hidden_dim)`` (each slice ``w[e]`` is an ``nn.Linear`` weight, torchtitan's layout), so expert
parallelism is a plain ``Shard(0)`` and a checkpoint's per-expert tensors are slices. Optional **shared experts**
(``num_shared_experts`` of them, one SwiGLU of width ``num_shared_experts * shared_hidden_dim``) see every token.

**Dropless**: every (token, expert) pair is computed, no capacity factor, so a token's result does not depend on
which other tokens share its batch or rank. The pairs are sorted by expert (``argsort`` of the flat expert ids,
stable), computed group by group, and combined back per token in a fixed order (the ``top_k`` slots summed in
order: no atomic scatter, deterministic on CUDA too).

**Static shapes** (``set_expert_dispatch(model, "padded")``, ``parallelism.expert_dispatch``): instead of the
expert-sorted rows, the experts get a zeroed ``(experts x capacity, dim)`` buffer, expert ``e``'s rows at the head of
its slice, ``capacity`` the block's token count (no expert can get more: still dropless); they compute every row
(batched matmuls, or the grouped matmul with static group ends) and each pair's output is read back from the row it
was written to, so the padding never reaches an output or a gradient. No host read, no data-dependent shape, at
``experts / top_k`` times the expert rows.

**Grouped matrix multiply** (``experts_impl``): ``"loop"`` runs one matmul per expert on its rows (exact in every
dtype); ``"grouped"`` runs ``torch._grouped_mm`` (2-D tokens x 3-D weights with int32 group end offsets). Its
constraints, read in torch 2.13 (``torch/_meta_registrations.py``, ``aten/src/ATen/native/GroupedMMUtils.h``):
float32, bfloat16 or float16 only (no float64 kernel); every operand's leading stride a multiple of 16 bytes, i.e.
``dim`` and ``hidden_dim`` multiples of ``16 / element_size``; the CUDA fast path (CUTLASS, no host sync) is bf16 on
compute capability 9.x/10.x, everything else (CPU included) runs torch's fallback, a loop of ``mm`` over the
groups. Each group is padded with zero rows to a multiple of ``16 / element_size`` rows (torchtitan's alignment for
the TMA-based kernel), computed on device without a host sync: the padded buffer has a static size (an upper bound,
the slack given to the last group, so no row is left unwritten) and zero rows give zero outputs and zero weight
gradients. ``"auto"`` (default) picks ``"grouped"`` on CUDA in bfloat16 / float16 when the sizes are aligned, else
``"loop"``. In float64 only ``"loop"`` runs; the two agree to float32 rounding where both run
(tests/models/test_moe.py).

**Load balancing.**

* The auxiliary-loss-free expert bias (DeepSeek-V3, arXiv 2408.15664): a persistent buffer ``expert_bias``
  (``load_balance_coeff`` set), used for selection only. Each training forward adds its tokens per expert to the
  non-persistent ``expert_load`` counter; after the optimizer step the training loop takes :func:`expert_loads`,
  sums them over every rank that saw other tokens (the data-parallel and sequence-sharding ranks: the *global*
  batch's loads), and calls :func:`update_expert_biases`: ``bias += coeff * sign(mean(load) - load)``, centred to
  keep the bias mean zero, then :func:`reset_moe_stats`. The model never communicates; the distributed side
  all-reduces the loads (``titanlike.parallel.expert_parallel.sync_expert_biases``).
* The optional sequence-wise auxiliary loss (DeepSeek-V3, eq. 17-20), coefficient ``aux_loss_coeff`` = alpha:
  for one sequence of ``T`` tokens, ``L_s = alpha * sum_i f_i P_i`` with ``f_i = E / (K T) * c_i`` (``c_i``: how many
  of its tokens picked expert ``i``, ``E`` experts, ``K = top_k``) and ``P_i = 1/T sum_t s'_ti`` (``s'``: the scores
  normalised over all experts per token); the step's value is the mean over the ``S`` sequences of the **global**
  batch, ``L = 1/S sum_s L_s``.

  *Why the sum over ranks equals the single-device value under any data or sequence split.* The counts ``c_si`` are
  integers (no gradient). Write ``L = sum_s sum_{t in s} l_t`` with the per-token term
  ``l_t = alpha / S * E / (K T_s^2) * sum_i c_si s'_ti``. Given the *whole* sequence's counts ``c_s`` (hence
  ``T_s = sum_i c_si / K``) and the global ``S``, every ``l_t`` is a function of token ``t`` alone, so any partition
  of the tokens over ranks (whole sequences per data-parallel rank, pieces of sequences per context-parallel rank, in
  any order, and micro-batches) gives contributions ``sum_{t local} l_t`` that add up to ``L`` exactly, value and
  gradient. Each rank therefore needs two global numbers: ``S``, set once per step (:func:`set_aux_loss_denominator`,
  like ``ScaledLoss.denominator``; a training forward with the aux loss on and no denominator is refused rather than
  silently normalised per rank), and, when sequences are split over ranks, the per-sequence counts summed over the
  ranks holding the other pieces (``MoE.aux_counts_reduce``, a function the sequence-parallel side sets; ``None``:
  sequences are whole on each rank).

  The contribution enters the gradient without entering the loss: the block's output passes through an identity
  autograd function whose backward also hands the aux term a gradient of 1 (Megatron-Core's
  ``MoEAuxLossAutoScaler``), i.e. the objective is ``sum(CE) / global_tokens + L``. This works under pipeline
  parallelism (a stage without the loss still adds its layers' terms) and gradient accumulation, and the logged
  ``loss`` stays the cross entropy; the terms themselves are read with :func:`aux_losses` (this rank's contribution
  per layer, to be summed over the data ranks for logging).

**Statistics**: ``MoE.last_load`` (tokens per expert of the latest forward, this rank's tokens) and ``expert_load``
(summed over the training forwards since the last :func:`reset_moe_stats`; an activation-checkpointing
recomputation, which runs inside the backward, is not counted twice).

**Initialization**: :func:`param_init_patterns` gives the ``titanlike.init`` distributions of every parameter (for a
model's ``param_init``); experts are generated per expert, so an expert-parallel rank generates only its experts.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titanlike.init import Init, init_parameters, trunc_normal
from titanlike.models.decoder import DecoderBlock
from titanlike.models.layers import FeedForward, RMSNorm, compute_dtype

__all__ = [
    "MoEDecoderBlock",
    "EXPERTS_IMPLS",
    "SCORE_FUNCS",
    "MoEArgs",
    "Router",
    "GroupedExperts",
    "clamped_swiglu",
    "MoE",
    "moe_modules",
    "expert_loads",
    "expert_bias_update",
    "update_expert_biases",
    "reset_moe_stats",
    "set_aux_loss_denominator",
    "aux_losses",
    "stats_paused",
    "balanced_routing",
    "init_moe_buffers",
    "param_init_patterns",
    "grouped_alignment",
    "expert_counts",
    "pad_groups",
    "EXPERT_DISPATCHES",
    "set_expert_dispatch",
    "padded_capacity",
]

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERTS_IMPLS = ("auto", "grouped", "loop")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
# how the expert-sorted rows reach the experts: "uneven" (exact per-expert groups, sizes read on the host) or
# "padded" (per-expert buffers of a static worst-case capacity, no host read; :func:`set_expert_dispatch`)
EXPERT_DISPATCHES = ("uneven", "padded")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch 2.13's _grouped_mm


@dataclass
class MoEArgs:
    dim: int
    hidden_dim: int  # per routed expert
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None  # per shared expert (default: hidden_dim)
    shared_gate: bool = False  # the shared experts' output scaled by sigmoid(x w), w (1, dim) (Qwen2-MoE, Qwen3-Next)
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_groups: int = 1  # group-limited routing: experts in num_groups groups, each token uses topk_groups of them
    topk_groups: int = 1
    load_balance_coeff: float | None = None  # aux-loss-free bias update speed (None: no bias)
    aux_loss_coeff: float = 0.0  # sequence-wise auxiliary loss coefficient alpha (0: off)
    experts_impl: str = "auto"
    # gpt-oss's options: a bias on the router's logits and on every expert projection, and its clamped gated
    # activation ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``
    router_bias: bool = False
    expert_bias_terms: bool = False
    activation: str = "swiglu"  # swiglu | clamped_swiglu
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("MoEArgs: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency of these arguments, one phrase with its fix each."""
        out = []
        for name in ("dim", "hidden_dim", "num_experts", "top_k", "num_groups", "topk_groups"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            out.append(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_hidden_dim is not None and self.shared_hidden_dim < 1:
            out.append(f"shared_hidden_dim must be >= 1 or None, got {self.shared_hidden_dim}")
        if self.score_func not in SCORE_FUNCS:
            out.append(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.experts_impl not in EXPERTS_IMPLS:
            out.append(f"experts_impl must be one of {EXPERTS_IMPLS}, got {self.experts_impl!r}")
        if self.activation not in ACTIVATIONS:
            out.append(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not self.route_scale > 0:
            out.append(f"route_scale must be > 0, got {self.route_scale}")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            out.append(f"load_balance_coeff must be > 0 or None (no bias), got {self.load_balance_coeff}")
        if not self.aux_loss_coeff >= 0:
            out.append(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if self.top_k > self.num_experts >= 1:
            out.append(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.num_groups >= 1 and self.num_experts % self.num_groups:
            out.append(f"num_groups {self.num_groups} does not divide num_experts {self.num_experts}")
        elif self.num_groups >= 1:
            if self.topk_groups > self.num_groups:
                out.append(f"topk_groups {self.topk_groups} exceeds num_groups {self.num_groups}")
            reachable = self.topk_groups * (self.num_experts // self.num_groups)
            if 1 <= self.topk_groups <= self.num_groups and self.top_k > reachable:
                out.append(
                    f"top_k {self.top_k} exceeds the {reachable} experts of the topk_groups {self.topk_groups} "
                    f"groups a token may use; raise topk_groups or lower top_k"
                )
        return out

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * (self.shared_hidden_dim or self.hidden_dim)

    def replace(self, **changes) -> MoEArgs:
        return replace(self, **changes)

    def _expert_params(self) -> int:
        d, h = self.dim, self.hidden_dim
        return 3 * d * h + (2 * h + d) * self.expert_bias_terms

    def num_params(self) -> int:
        """Parameters of one block: router, every routed expert, the shared experts (biases included) and their gate."""
        d, e = self.dim, self.num_experts
        gate = d if self.shared_gate and self.num_shared_experts else 0
        return (d + self.router_bias) * e + self._expert_params() * e + 3 * d * self.shared_width + gate

    def active_params(self) -> int:
        """Parameters one token uses: router, ``top_k`` routed experts, the shared experts and their gate."""
        d, e = self.dim, self.num_experts
        gate = d if self.shared_gate and self.num_shared_experts else 0
        return (d + self.router_bias) * e + self._expert_params() * self.top_k + 3 * d * self.shared_width + gate


class Router(nn.Module):
    """Token-choice top-k routing. ``forward(x (N, dim), expert_bias (E,) or None)`` returns ``scores`` (N, E) (in
    at least float32), the picked expert ids ``idx`` (N, top_k) and their routing ``weights`` (N, top_k)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(args.dim, args.num_experts, bias=args.router_bias)

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        a = self.args
        logits = self.gate(x).to(compute_dtype(x))
        scores = logits.softmax(dim=-1) if a.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():  # the selection has no gradient; the weights below take it from the scores
            choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
            if a.num_groups > 1:
                choice = _limit_to_top_groups(choice, a.num_groups, a.topk_groups)
            idx = choice.topk(a.top_k, dim=-1).indices if not _BALANCED[0] else _round_robin(x.shape[0], a, x.device)
        weights = scores.gather(-1, idx)
        if a.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, idx, weights * a.route_scale


def _limit_to_top_groups(choice: Tensor, num_groups: int, topk_groups: int) -> Tensor:
    """``choice`` with every expert outside each token's ``topk_groups`` best groups set to -inf; a group's score is
    the sum of its two best entries (DeepSeek-V3; its only one for groups of one expert)."""
    n, e = choice.shape
    grouped = choice.view(n, num_groups, e // num_groups)
    group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
    keep = torch.zeros(n, num_groups, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)


def expert_counts(idx: Tensor, num_experts: int) -> Tensor:
    """(num_experts,) int64: how many of the picked expert ids ``idx`` name each expert. A scatter-add of ones
    rather than ``bincount``, whose output length depends on the ids' values: this one's is static, so
    ``torch.compile`` captures it in the block's graph."""
    flat = idx.reshape(-1)
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_alignment(dtype: torch.dtype) -> int:
    """Rows (and ``dim`` / ``hidden_dim`` elements) per 16 bytes: what ``torch._grouped_mm`` aligns to."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def pad_groups(x: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """The expert-sorted rows ``x`` (M, dim) with each expert's group padded by zero rows to a multiple of ``align``.

    Returns ``(padded, rows, offsets)``: ``padded`` of a static size (``M`` plus the worst-case padding, rounded up
    to ``align``; the slack goes to the last group so every row belongs to a group), ``rows`` (M,) the row of
    ``padded`` holding each row of ``x``, ``offsets`` (E,) int32 group end offsets for ``torch._grouped_mm``. All on
    ``x``'s device, with no host synchronisation.
    """
    m, e = x.shape[0], counts.numel()
    counts = counts.to(torch.int64)
    cap = -(-(m + e * (align - 1)) // align) * align
    padded_counts = (counts + align - 1) // align * align
    padded_starts = padded_counts.cumsum(0) - padded_counts
    starts = counts.cumsum(0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=m)
    rows = torch.arange(m, device=x.device) + (padded_starts - starts)[expert_of_row]
    ends = torch.cat([padded_starts[1:], padded_starts.new_full((1,), cap)])
    padded = x.new_zeros(cap, x.shape[1]).index_copy(0, rows, x)
    return padded, rows, ends.to(torch.int32)


def _split_sizes(counts: Tensor, rows: int) -> list[int]:
    """The rows per expert on the host (one synchronisation), with what a compiled block needs to know of them:
    under ``torch.compile`` (``capture_scalar_outputs``) they are unbacked symbolic sizes, and these checks let the
    split trace without a graph break or a guard on their values."""
    sizes = counts.tolist()
    for size in sizes:
        torch._check(size >= 0)
    torch._check(sum(sizes) == rows)
    return sizes


def _loop_swiglu(x: Tensor, counts: Tensor | list[int], w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """One SwiGLU per expert on its rows (every expert, empty groups too, so every weight gets a gradient). The
    weights are ``unbind``-ed once: indexing ``w[e]`` per expert makes each expert's backward write a full-size zero
    gradient (E times the weight's memory traffic: 110 vs 35 ms forward + backward for 16 experts, 2048 rows, dim
    128, hidden 256, float32, one CPU thread)."""
    outs = []
    sizes = counts if isinstance(counts, list) else _split_sizes(counts, x.shape[0])
    for rows, a, b, c in zip(torch.split(x, sizes), w1.unbind(0), w2.unbind(0), w3.unbind(0)):
        outs.append((F.silu(rows @ a.T) * (rows @ c.T)) @ b.T)
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g =
    clamp(gate, max=limit)`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _loop_biased(x: Tensor, counts: Tensor | list[int], ws: tuple[Tensor, ...], act: Callable) -> Tensor:
    """:func:`_loop_swiglu` with a bias on every projection and any gated activation ``act(gate, up)``: ``ws`` =
    (w1, w2, w3, b1, b2, b3), biases (experts, out features)."""
    outs = []
    sizes = counts if isinstance(counts, list) else _split_sizes(counts, x.shape[0])
    for rows, a, b, c, ba, bb, bc in zip(torch.split(x, sizes), *(w.unbind(0) for w in ws)):
        outs.append(act(rows @ a.T + ba, rows @ c.T + bc) @ b.T + bb)
    return torch.cat(outs) if outs else x.new_zeros(0, ws[1].shape[1])


def _grouped_swiglu(
    x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, mm=None, align: int | None = None
) -> Tensor:
    """The same through a grouped matmul on zero-padded groups (``mm``: default ``torch._grouped_mm``; ``align``:
    rows per group multiple, default :func:`grouped_alignment`)."""
    mm = mm or torch._grouped_mm
    padded, rows, offs = pad_groups(x, counts, align or grouped_alignment(x.dtype))
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    h = F.silu(mm(padded, w1.transpose(-2, -1), offs=offs)) * mm(padded, w3.transpose(-2, -1), offs=offs)
    return mm(h, w2.transpose(-2, -1), offs=offs).index_select(0, rows)


def _local(w: Tensor) -> Tensor:
    """The part of a weight this process computes with: a sharded tensor's local shard (expert parallelism hands
    the block DTensors sharded over experts; the model imports nothing of torch.distributed), else the weight.
    Told apart by the shard it holds (``_local_tensor``): dynamo answers ``hasattr(w, "to_local")`` False for a
    DTensor (torch 2.13), so a compiled block would compute with the whole DTensor."""
    return w.to_local() if hasattr(w, "_local_tensor") else w


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights; ``forward(x, counts)`` maps the expert-sorted rows ``x``
    (M, dim), ``counts[e]`` rows per expert, to their outputs (M, dim). The unit expert parallelism wraps: it
    dispatches the rows to the ranks holding their experts before, and combines them back after."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        impl: str = "auto",
        *,
        bias: bool = False,
        activation: str = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ):
        super().__init__()
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f"GroupedExperts: impl must be one of {EXPERTS_IMPLS}, got {impl!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupedExperts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if impl == "grouped" and (bias or activation != "swiglu"):
            raise ValueError(
                "GroupedExperts impl 'grouped': biased / clamped experts run the loop; use 'loop' or 'auto'"
            )
        self.num_experts, self.impl = num_experts, impl
        self.dispatch = "uneven"  # EXPERT_DISPATCHES; set by set_expert_dispatch (the MoE block reads it too)
        self.activation, self.alpha, self.limit = activation, alpha, limit
        # A swap point for another grouped matmul with ``torch._grouped_mm``'s calling convention, ``mm(a, b_t,
        # offs=offs)`` (a: rows, row-major; b_t: (experts, in, out), column-major per expert; offs: int32 group
        # ends), e.g. torchao's float8 one (``titanlike.kernels.float8.convert_experts_to_float8``); each group is
        # then padded to ``grouped_mm_align`` rows. Set, it always takes the grouped path.
        self.grouped_mm: Callable | None = None
        self.grouped_mm_align: int | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # gpt-oss: a bias per expert on each projection (experts on dim 0, so expert parallelism splits them alike)
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim)) if bias else None

    def _biases(self, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The local (b1, b2, b3), zeros when the experts have none."""
        if self.b1 is None:
            return w1.new_zeros(w1.shape[:2]), w2.new_zeros(w2.shape[:2]), w1.new_zeros(w1.shape[:2])
        return _local(self.b1), _local(self.b2), _local(self.b3)

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(gate, up, self.alpha, self.limit)
        return F.silu(gate) * up

    def resolved_impl(self, x: Tensor) -> str:
        """``"grouped"`` or ``"loop"`` for input ``x`` (``auto``: grouped on CUDA in bf16/fp16 with aligned sizes;
        always grouped with a swapped-in ``grouped_mm``)."""
        dim, hidden = self.w1.shape[2], self.w1.shape[1]
        if self.grouped_mm is not None:
            return "grouped"
        if self.impl == "loop" or self.b1 is not None or self.activation != "swiglu":
            return "loop"
        why = None
        if x.dtype not in GROUPED_MM_DTYPES:
            why = f"torch._grouped_mm has no {x.dtype} kernel (float32, bfloat16, float16 only)"
        elif dim % grouped_alignment(x.dtype) or hidden % grouped_alignment(x.dtype):
            why = f"dim {dim} and hidden_dim {hidden} must be multiples of {grouped_alignment(x.dtype)} in {x.dtype}"
        if self.impl == "grouped":
            if why:
                raise ValueError(f"GroupedExperts impl 'grouped': {why}; use impl 'loop' or 'auto'")
            return "grouped"
        return "grouped" if why is None and x.is_cuda and x.dtype != torch.float32 else "loop"

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.dispatch == "padded":
            return self._padded(x, w1, w2, w3)
        if counts.numel() != w1.shape[0]:
            raise ValueError(
                f"GroupedExperts: got token counts for {counts.numel()} experts but computes {w1.shape[0]}; "
                f"weights sharded over experts need the expert-parallel dispatch (titanlike.parallel.apply_ep)"
            )
        if self.b1 is not None or self.activation != "swiglu":
            ws = (w1, w2, w3, *self._biases(w1, w2))
            sizes = [x.shape[0] // w1.shape[0]] * w1.shape[0] if _BALANCED[0] else counts
            return _loop_biased(x, sizes, ws, self._act)
        if self.resolved_impl(x) == "grouped":
            return _grouped_swiglu(x, counts, w1, w2, w3, self.grouped_mm, self.grouped_mm_align)
        if _BALANCED[0]:  # every local expert the same rows, known from the shapes (no host read of the counts)
            return _loop_swiglu(x, [x.shape[0] // w1.shape[0]] * w1.shape[0], w1, w2, w3)
        return _loop_swiglu(x, counts, w1, w2, w3)

    def _padded(self, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        """The padded dispatch's compute: ``x`` (local experts x R, dim), every local expert's R rows contiguous
        (its valid rows, then zero rows); one batched matmul per projection (a grouped matmul with the static group
        ends ``R, 2R, ...`` where :meth:`resolved_impl` picks it), every shape static. Padded rows give outputs that
        nobody reads (so zero gradients); ``R`` is a multiple of the grouped matmul's row alignment
        (:func:`padded_capacity`)."""
        local = w1.shape[0]
        if self.resolved_impl(x) == "grouped":
            mm, rows = self.grouped_mm or torch._grouped_mm, x.shape[0] // local
            offs = torch.arange(1, local + 1, device=x.device, dtype=torch.int32) * rows
            w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
            h = F.silu(mm(x, w1.transpose(-2, -1), offs=offs)) * mm(x, w3.transpose(-2, -1), offs=offs)
            return mm(h, w2.transpose(-2, -1), offs=offs)
        b1, b2, b3 = self._biases(w1, w2)
        xb = x.view(local, x.shape[0] // local, x.shape[-1])
        gate, up = torch.bmm(xb, w1.transpose(1, 2)), torch.bmm(xb, w3.transpose(1, 2))
        if self.b1 is not None:
            gate, up = gate + b1[:, None], up + b3[:, None]
        out = torch.bmm(self._act(gate, up), w2.transpose(1, 2))
        if self.b1 is not None:
            out = out + b2[:, None]
        return out.reshape(x.shape[0], out.shape[-1])


def padded_capacity(tokens: int, experts: GroupedExperts, dtype: torch.dtype) -> int:
    """Rows per (rank, expert) buffer of the padded dispatch: ``tokens`` (a token picks an expert at most once, so
    no expert ever gets more of one rank's tokens: dropless), rounded up to the grouped matmul's row alignment."""
    align = experts.grouped_mm_align or grouped_alignment(dtype)
    return -(-tokens // align) * align


def _padded_positions(idx: Tensor, order: Tensor, counts: Tensor, capacity: int) -> Tensor:
    """Row of the (experts x capacity) buffer holding each expert-sorted (token, slot) pair: expert ``e``'s ``j``-th
    row at ``e * capacity + j`` (device arithmetic only)."""
    expert = idx.reshape(-1).index_select(0, order)
    starts = counts.cumsum(0) - counts
    return expert * capacity + torch.arange(order.numel(), device=order.device) - starts.index_select(0, expert)


def set_expert_dispatch(model: nn.Module, dispatch: str) -> None:
    """How every MoE block of ``model`` hands its rows to the experts (``parallelism.expert_dispatch``):

    * ``"uneven"``: the rows sorted by expert, each expert's exact group (sizes read on the host: the loop's splits,
      the expert-parallel split sizes);
    * ``"padded"``: a zeroed (experts, capacity, dim) buffer, expert ``e``'s rows first in its slice, capacity the
      rank's tokens (:func:`padded_capacity`: dropless), the outputs read back at the same device-computed rows.
      No host read and no data-dependent shape, forward or backward (CUDA-graph friendly); costs experts / top_k
      times the rows in expert compute and (under expert parallelism) all-to-all bytes.
    """
    if dispatch not in EXPERT_DISPATCHES:
        raise ValueError(f"expert dispatch must be one of {EXPERT_DISPATCHES}, got {dispatch!r}")
    for m in moe_modules(model):
        m.experts.dispatch = dispatch


class _AddAuxGradient(torch.autograd.Function):
    """Identity on ``out``; the backward also gives ``aux`` the gradient 1, adding ``aux`` to the objective without
    adding it to the loss (Megatron-Core's MoEAuxLossAutoScaler with a scale of 1: the loss contract's micro-batch
    losses are already divided by the global denominators)."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def _in_backward() -> bool:
    """True inside an autograd backward pass (an activation-checkpointing recomputation runs there). False while
    ``torch.compile`` traces a block: its forward is traced once, in the forward, and a checkpoint inside the compiled
    block is recomputed by the compiled backward, not by running this code again."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


_STATS_PAUSED = [0]


@contextlib.contextmanager
def stats_paused():
    """Forwards that are not training steps leave every block's load counter and aux-loss sum alone (a pipeline
    stage's metadata inference: torch >= 2.13 runs each stage once on empty tensors at the first step)."""
    _STATS_PAUSED[0] += 1
    try:
        yield
    finally:
        _STATS_PAUSED[0] -= 1


_BALANCED = [0]


@contextlib.contextmanager
def balanced_routing():
    """Route every token round-robin instead of by its scores: the ``top_k`` slots of token ``i`` pick experts
    ``(i k + j) mod E``, so every expert gets the same number of rows (``tokens x top_k`` must divide by ``E``),
    known from the shapes alone. The routing weights still come from the scores (the router keeps its gradient).
    For shape-only runs (the planner's activation probe under ``FakeTensorMode``, where the data-dependent
    ``bincount`` and per-expert row counts cannot be read) and for runs that need a known, perfectly even load (the
    planner's all-to-all bytes against a real expert-parallel step)."""
    _BALANCED[0] += 1
    try:
        yield
    finally:
        _BALANCED[0] -= 1


def _round_robin(n: int, a: MoEArgs, device) -> Tensor:
    if (n * a.top_k) % a.num_experts:
        raise ValueError(
            f"balanced_routing: {n} tokens x top_k {a.top_k} do not divide over {a.num_experts} experts evenly"
        )
    return (torch.arange(n * a.top_k, device=device) % a.num_experts).view(n, a.top_k)


def _counting(module: nn.Module) -> bool:
    """Whether this forward's loads and aux loss are recorded: a training forward, not an AC recomputation (in
    backward), not paused."""
    return module.training and not _in_backward() and not _STATS_PAUSED[0]


class MoE(nn.Module):
    """The MoE feed-forward block (see the module docstring): ``forward(x (batch, seq, dim))``."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(args)
        self.experts = GroupedExperts(
            args.num_experts,
            args.dim,
            args.hidden_dim,
            args.experts_impl,
            bias=args.expert_bias_terms,
            activation=args.activation,
            alpha=args.swiglu_alpha,
            limit=args.swiglu_limit,
        )
        self.shared_experts = FeedForward(args.dim, args.shared_width) if args.num_shared_experts else None
        # Qwen3-Next's gate on the shared experts (sigmoid of one projection of the token)
        self.shared_gate = nn.Linear(args.dim, 1, bias=False) if args.shared_gate and args.num_shared_experts else None
        if args.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("expert_load", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.last_load: Tensor | None = None
        # the aux loss's global numbers (module docstring): S, and the per-sequence count sum over sequence shards
        self.aux_loss_denominator: float | Tensor | None = None
        self.aux_counts_reduce: Callable[[Tensor], Tensor] | None = None
        self.aux_loss_sum: Tensor | None = None  # this rank's contribution since the last reset (detached)

    def forward(self, x: Tensor) -> Tensor:
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        scores, idx, weights = self.router(flat, self.expert_bias)
        k = idx.shape[1]
        padded = self.experts.dispatch == "padded"
        if _BALANCED[0]:  # round-robin routing: every expert the same rows (no data-dependent bincount)
            counts = idx.new_full((self.args.num_experts,), idx.numel() // self.args.num_experts)
        else:
            counts = expert_counts(idx, self.args.num_experts)
        if _counting(self):
            self.last_load = counts.detach()
            self.expert_load += counts
        order = idx.reshape(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert
        rows = flat.index_select(0, order // k)
        if padded:  # each expert's rows at the head of its fixed-size slice of a zeroed buffer
            capacity = padded_capacity(flat.shape[0], self.experts, flat.dtype)
            at = _padded_positions(idx, order, counts, capacity)
            buffer = rows.new_zeros(self.args.num_experts * capacity, dim).index_copy(0, at, rows)
            routed = self.experts(buffer, counts).index_select(0, at)
        else:
            routed = self.experts(rows, counts)
        out = self.combine(routed, weights, order).view(bsz, seqlen, dim)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        if self.training and self.args.aux_loss_coeff > 0:
            aux = self.sequence_aux_loss(scores, idx, bsz)
            if _counting(self):
                self.aux_loss_sum = aux.detach() + (0 if self.aux_loss_sum is None else self.aux_loss_sum)
            out = _AddAuxGradient.apply(out, aux)
        return out

    @staticmethod
    def combine(routed: Tensor, weights: Tensor, order: Tensor) -> Tensor:
        """Per token, the sum over its ``top_k`` slots (in slot order) of weight x expert output; ``routed`` is in
        ``order`` (expert-sorted), returns (tokens, dim) in ``routed``'s dtype."""
        n, k = weights.shape
        unsorted = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        per_slot = routed.index_select(0, unsorted).view(n, k, -1)
        return (per_slot.to(weights.dtype) * weights[..., None]).sum(dim=1).to(routed.dtype)

    def sequence_aux_loss(self, scores: Tensor, idx: Tensor, bsz: int) -> Tensor:
        """This rank's contribution to the sequence-wise auxiliary loss (module docstring, per-token form)."""
        a = self.args
        if self.aux_loss_denominator is None:
            raise ValueError(
                "MoE aux loss: the global number of sequences of this step is not set; call "
                "titanlike.models.moe.set_aux_loss_denominator(model, global_batch_sequences) before the forward "
                "(a per-rank count would normalise the aux loss per rank)"
            )
        e = a.num_experts
        normed = (scores / scores.sum(dim=-1, keepdim=True)).view(bsz, -1, e)
        with torch.no_grad():
            one_hot = torch.zeros(idx.shape[0], e, dtype=scores.dtype, device=scores.device)
            one_hot.scatter_(1, idx, 1.0)
            seq_counts = one_hot.view(bsz, -1, e).sum(dim=1)  # (bsz, E): this rank's tokens of each sequence
            if self.aux_counts_reduce is not None:
                seq_counts = self.aux_counts_reduce(seq_counts)
            seq_len = seq_counts.sum(dim=-1, keepdim=True) / a.top_k  # T_s of the whole sequence
            coeff = a.aux_loss_coeff * e / (a.top_k * seq_len**2) * seq_counts / self.aux_loss_denominator
        return (normed.sum(dim=1) * coeff).sum()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """Zero the expert bias and the load counter (after ``to_empty``, or to restart balancing)."""
        device = device or self.expert_load.device
        self.expert_load = torch.zeros(self.args.num_experts, dtype=torch.int64, device=device)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros_like(self.expert_bias, device=device)
        self.last_load, self.aux_loss_sum = None, None

    def init_weights(self, seed: int | None = None, prefix: str = "") -> None:
        """This block's parameters and buffers as :func:`param_init_patterns` makes them (``prefix``: the block's
        FQN prefix in the full model, e.g. ``"layers.3.moe."``)."""
        self.init_buffers()
        plan = param_init_patterns(re.escape(prefix), depth=_depth_of(prefix))
        init_parameters(self, plan, torch.initial_seed() if seed is None else seed, prefix=prefix)


class MoEDecoderBlock(DecoderBlock):
    """``h = x + attention(attention_norm(x))``, then ``h + ffn(ffn_norm(h))``: the ``moe`` block in the layers
    ``args.is_moe_layer`` names, a dense SwiGLU ``feed_forward`` in the others (``first_k_dense_replace``). A model
    sets ``attention_class`` (built from its args: Qwen3's GQA attention, DeepSeek-V3's MLA) and ``param_init``."""

    attention_class: ClassVar[Callable[[object], nn.Module]]

    def __init__(self, layer_id: int, args):
        super().__init__(layer_id, args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = type(self).attention_class(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.moe_args())
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), **kwargs)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


def _depth_of(prefix: str) -> int:
    m = re.search(r"(\d+)", prefix)
    return int(m.group(1)) if m else 0


def param_init_patterns(prefix: str = "", depth: int | None = None) -> dict[str, Init | Callable[[re.Match], Init]]:
    """``titanlike.init`` patterns (``{regex: Init or fn(match) -> Init}``, :func:`titanlike.init.plan_from_patterns`)
    for the parameters of MoE blocks under the regex ``prefix`` (e.g. ``r"layers\\.(\\d+)\\.moe\\."``).

    The Llama rules: the router gate and the projections reading the residual stream (``w1``) truncated normal,
    std 0.02; those writing into it (``w2``, ``w3``) depth-scaled, std 0.02 / sqrt(2 (layer + 1)), the layer taken from
    ``prefix``'s first group (or ``depth``). Each expert is its own tile row of the generator, so the values are those
    of one expert at a time and a rank holding some experts generates only those.
    """

    def residual(m: re.Match) -> Init:
        layer = depth if depth is not None else (int(m.group(1)) if m.re.groups else 0)
        return trunc_normal(0.02 / math.sqrt(2 * (layer + 1)))

    return {
        prefix + r"router\.gate\.weight": trunc_normal(0.02),
        prefix + r"experts\.w1": trunc_normal(0.02),
        prefix + r"experts\.(w2|w3)": residual,
        prefix + r"shared_experts\.w1\.weight": trunc_normal(0.02),
        prefix + r"shared_experts\.(w2|w3)\.weight": residual,
        prefix + r"shared_gate\.weight": trunc_normal(0.02),
    }


# ------------------------------------------------------------------------------------------ the training loop's side
def moe_modules(model: nn.Module) -> list[MoE]:
    """Every MoE block of ``model``, in module order (the row order of :func:`expert_loads`)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_loads(model: nn.Module) -> Tensor:
    """(layers, experts) int64: this rank's tokens per expert since the last :func:`reset_moe_stats`, one row per MoE
    block. Sum it over the ranks that saw other tokens before :func:`update_expert_biases`."""
    blocks = moe_modules(model)
    if not blocks:
        raise ValueError(f"expert_loads: {type(model).__name__} has no MoE block")
    return torch.stack([m.expert_load for m in blocks])


def expert_bias_update(bias: Tensor, load: Tensor, coeff: float) -> Tensor:
    """The aux-loss-free update: ``bias + coeff * sign(mean(load) - load)``, the step centred to mean zero
    (overloaded experts are pushed down, underloaded ones up; selection is invariant to a common shift)."""
    load = load.to(torch.float64)
    step = coeff * torch.sign(load.mean() - load)
    return bias + (step - step.mean()).to(bias.dtype)


@torch.no_grad()
def update_expert_biases(model: nn.Module, loads: Tensor) -> None:
    """Apply :func:`expert_bias_update` to every MoE block with a bias, from ``loads`` (layers, experts): the
    **global** batch's loads (:func:`expert_loads` summed over the data and sequence ranks)."""
    blocks = moe_modules(model)
    if loads.shape != (len(blocks), blocks[0].args.num_experts if blocks else 0):
        raise ValueError(f"update_expert_biases: loads of shape {tuple(loads.shape)} for {len(blocks)} MoE blocks")
    for m, load in zip(blocks, loads):
        if m.expert_bias is not None:
            m.expert_bias.copy_(expert_bias_update(m.expert_bias, load, m.args.load_balance_coeff))


def reset_moe_stats(model: nn.Module) -> None:
    """Start a new step: zero every block's load counter and aux-loss sum."""
    for m in moe_modules(model):
        m.expert_load.zero_()
        m.aux_loss_sum = None


def set_aux_loss_denominator(model: nn.Module, sequences: float | Tensor) -> None:
    """The number of sequences of this step's **global** batch (every micro-batch of every data-parallel rank),
    the aux loss's denominator, on every MoE block (set it once per step, like ``ScaledLoss.denominator``)."""
    for m in moe_modules(model):
        m.aux_loss_denominator = sequences


def aux_losses(model: nn.Module) -> Tensor:
    """(layers,) float64, on the blocks' device (one copy to the host per step, by the caller, not one per block):
    this rank's aux-loss contributions since the last reset (zero where off); their sum over the data ranks is the
    step's auxiliary loss per layer."""
    blocks = moe_modules(model)
    if not blocks:
        return torch.zeros(0, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=blocks[0].expert_load.device)
    return torch.stack([zero if m.aux_loss_sum is None else m.aux_loss_sum.to(torch.float64) for m in blocks])


def init_moe_buffers(model: nn.Module, device: torch.device | None = None) -> None:
    """:meth:`MoE.init_buffers` on every block (after ``to_empty`` on a model built on the meta device)."""
    for m in moe_modules(model):
        m.init_buffers(device)
