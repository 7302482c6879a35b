"""Context parallelism: every sequence split over the ``cp`` ranks, attention exact, applied from outside.

Every model calls its attention through the shared seam (``titanlike.models.decoder.AttentionCore``: causal
softmax attention of ``(batch, seq, heads, head_dim)`` queries over keys / values with fewer, grouped heads) and
takes its positions from the shared position seam (``titanlike.models.decoder.Positions``: the RoPE rows and the
learned position embeddings are looked up there). :func:`apply_cp` swaps the first for a
:class:`ContextParallelAttention` and the second for :class:`ContextParallelPositions` (the global positions of the
local tokens); nothing else in the model changes, and parameter names stay the same.

Load balance. A sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``C = S / (2 * cp)``; cp rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` (one early, one late), so every rank has the same causal work::

    cp = 2, S = 8 tokens, C = 2:   chunks  0: t0 t1 | 1: t2 t3 | 2: t4 t5 | 3: t6 t7
                                   rank 0 holds chunks 0 and 3 (t0 t1 t6 t7), rank 1 chunks 1 and 2 (t2 t3 t4 t5)

Attention (all-gather K/V, Llama 3's CP). Queries stay local. K and V (kv heads only, after RoPE) are
all-gathered over the cp group in forward (one ``all_gather_into_tensor`` each per layer); their gradients are
reduce-scattered in backward (one ``reduce_scatter_tensor`` each; a rank's K/V feed every rank's queries, so the
gradient of its tokens is the sum over ranks). The gathered K/V are put back into global order and each local
query chunk ``j`` attends to keys ``[0, (j + 1) * C)`` with the causal mask aligned to the bottom right
(``torch.nn.attention.bias.causal_lower_right``): on CUDA that is the flash / memory-efficient kernel, no
``S x S`` mask is built; on CPU torch builds the ``C x (j + 1) C`` boolean mask of the chunk.

Other methods (``parallelism.context_parallel_method``, :func:`apply_cp`'s ``method``): "alltoall" (DeepSpeed-Ulysses,
:class:`UlyssesAttention`: an all-to-all turns the sequence split of q, k, v into a head split, the plain seam attends
over the whole sequence for ``heads / cp`` heads, an all-to-all turns the output back) and "ring"
(``titanlike.parallel.ring_attention``: K/V blocks passed around the cp group, merged by log-sum-exp).

Around it: the data loader hands each cp rank its two chunks of the same samples (:func:`cp_shard`, the inputs
and the labels alike); the loss counts tokens over ``dp x cp`` (the ``dp_cp`` mesh); FSDP shards parameters and
sums gradients over ``dp_shard x cp`` (``dp_shard_cp``), which is where the weight gradients of the different
chunks meet. See docs/context_parallel.md.

Document masking (``block_causal``): the forward's ``DocumentMask`` holds the global positions of the local tokens
and their documents' starts (cut like the inputs by the data loader), so the mask of each query chunk against the
gathered keys is a function of local data: no extra collective (``DocumentMask.attend`` with the chunk's rows).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from titanlike.loss import shift_labels
from titanlike.models.decoder import AttentionCore, LatentAttentionCore, Positions, SequenceWindow
from titanlike.models.linear_attention import GatedDeltaCore, ShortConvCore
from titanlike.models.masking import DocumentMask, window_keys, window_tail
from titanlike.parallel.ring_attention import RingAttention, RingLatentAttention, ring_attention
from titanlike.parallel.state_passing import ContextParallelGatedDelta, ContextParallelShortConv

__all__ = [
    "ContextParallelAttention",
    "ContextParallelLatentAttention",
    "ContextParallelPositions",
    "ContextParallelWindow",
    "HybridAttention",
    "HybridLatentAttention",
    "METHODS",
    "UlyssesAttention",
    "UlyssesLatentAttention",
    "cp_shift_labels",
    "apply_cp",
    "chunk_attention",
    "chunk_ids",
    "cp_positions",
    "cp_shard",
    "cp_unshard",
    "hybrid_layout",
    "hybrid_meshes",
]


# ---------------------------------------------------------------------------------------------- the layout
def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunks (of ``2 * cp``) that cp rank ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> Tensor:
    """Global positions of cp rank ``rank``'s ``seq_len / cp`` tokens of a ``seq_len``-token sequence."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in chunk_ids(cp, rank)])


def cp_shard(t: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This cp rank's tokens of ``t`` along the sequence dim ``dim`` (chunks ``r`` and ``2 cp - 1 - r``)."""
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=dim)
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"context parallel: sequence length {t.shape[dim]} is not divisible by 2 x cp = {2 * cp}")
    return torch.cat([chunks[j] for j in chunk_ids(cp, rank)], dim=dim).contiguous()


def _global_order(cp: int) -> list[int]:
    """Where global chunk j sits in the rank-ordered gather of (rank 0's two chunks, rank 1's, ...)."""
    where = {}
    for r in range(cp):
        for half, j in enumerate(chunk_ids(cp, r)):
            where[j] = 2 * r + half
    return [where[j] for j in range(2 * cp)]


def cp_unshard(t: Tensor, cp: int, dim: int = 1) -> Tensor:
    """Inverse of :func:`cp_shard` for a rank-ordered concatenation of every cp rank's shard."""
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[k] for k in _global_order(cp)], dim=dim)


# ---------------------------------------------------------------------------------------------- collectives
# Collectives along dim 0 (the sequence is moved there: free for the usual batch of 1), so that one
# all_gather_into_tensor / reduce_scatter_tensor carries the message with no chunk-and-concatenate around it.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _wait(t: Tensor) -> Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather_seq(x: Tensor, mesh: DeviceMesh) -> Tensor:
    return _wait(_ALL_GATHER(x.transpose(0, 1).contiguous(), 0, mesh)).transpose(0, 1)


def _kv_grad_reduce(grad: Tensor, mesh: DeviceMesh) -> Tensor:
    """Backward of the K/V all-gather: every rank's queries contributed to every key; sum and keep ours."""
    return _wait(_REDUCE_SCATTER(grad.transpose(0, 1).contiguous(), "sum", 0, mesh)).transpose(0, 1)


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (dim 1) over the cp mesh; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh) -> Tensor:
        ctx.mesh = mesh
        return _gather_seq(x, mesh)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _kv_grad_reduce(grad, ctx.mesh), None


def all_gather_sequence(x: Tensor, mesh: DeviceMesh) -> Tensor:
    return _AllGatherSequence.apply(x, mesh)


# ---------------------------------------------------------------------------------------------- the core
class ContextParallelAttention(nn.Module):
    """Causal grouped-query attention of this cp rank's queries over the whole sequence's keys / values.

    Same interface as the plain core: ``q (batch, s, heads, head_dim)``, ``k, v (batch, s, kv_heads, head_dim)``
    with ``s = seq_len / cp`` this rank's tokens (chunks ``r`` and ``2 cp - 1 - r``); returns ``(batch, s, heads,
    head_dim)``. Every cp rank of the mesh must call it (the all-gathers are collectives).

    ``window`` / ``sinks``: the plain core's options (taken from it by :func:`apply_cp`). A sliding-window layer
    whose window fits a chunk (``window - 1 <= C``) gathers only what the window can see: the last ``window - 1``
    keys / values of every chunk (:meth:`_windowed`: ``2 cp (window - 1)`` tokens per layer instead of ``S``; exact,
    the query positions global); a wider window gathers everything and masks.
    """

    attention_seam = True

    def __init__(self, cp_mesh: DeviceMesh, window: int | None = None, sinks: bool = False):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, chunks={chunk_ids(self.cp, self.rank)}, window={self.window}"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        cp, c = self.cp, q.shape[1] // 2
        if mask is None and (self.window is not None or sinks is not None):  # outside a decoder: the causal mask
            positions = cp_positions(q.shape[1] * cp, cp, self.rank, q.device)
            mask = DocumentMask.causal(q.shape[0], positions, (self.window,))
        if window_tail(c, self.window) is not None:
            return self._windowed(q, k, v, mask, sinks)
        k_all = reorder_gathered(all_gather_sequence(k, self.cp_mesh), cp)
        v_all = reorder_gathered(all_gather_sequence(v, self.cp_mesh), cp)
        kt, vt = _repeat_kv(k_all, q).transpose(1, 2), _repeat_kv(v_all, q).transpose(1, 2)
        plain = self.window is None and sinks is None
        outs = []
        for half, j in enumerate(chunk_ids(cp, self.rank)):
            qj = q[:, half * c : (half + 1) * c].transpose(1, 2)
            if mask is None or (plain and not mask.documents):
                outs.append(chunk_attention(qj, kt[:, :, : (j + 1) * c], vt[:, :, : (j + 1) * c]).transpose(1, 2))
                continue
            # the chunk's rows of the mask (global positions, local document starts) against the keys it can see
            k0, k1 = window_keys(j * c, (j + 1) * c - 1, self.window)
            rows = (half * c, (half + 1) * c)
            out = mask.attend(qj, kt[:, :, k0:k1], vt[:, :, k0:k1], rows, window=self.window, sinks=sinks, key_start=k0)
            outs.append(out.transpose(1, 2))
        return torch.cat(outs, dim=1)

    def _windowed(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, sinks: Tensor | None) -> Tensor:
        """Sliding-window attention gathering only the last ``t = window - 1`` keys / values of every chunk (one
        all-gather each of ``2 t`` tokens per rank; their gradients reduce-scattered): global chunk ``j`` attends to
        the tail of chunk ``j - 1`` and its own keys, the range :func:`window_keys` gives."""
        cp, c = self.cp, q.shape[1] // 2
        t = window_tail(c, self.window)
        if t:
            tails_k = torch.cat([k[:, (h + 1) * c - t : (h + 1) * c] for h in (0, 1)], dim=1)
            tails_v = torch.cat([v[:, (h + 1) * c - t : (h + 1) * c] for h in (0, 1)], dim=1)
            tails_k = reorder_gathered(all_gather_sequence(tails_k, self.cp_mesh), cp)  # (b, 2 cp t): chunk order
            tails_v = reorder_gathered(all_gather_sequence(tails_v, self.cp_mesh), cp)
        outs = []
        for half, j in enumerate(chunk_ids(cp, self.rank)):
            own = slice(half * c, (half + 1) * c)
            kj, vj = k[:, own], v[:, own]
            if t and j > 0:
                kj = torch.cat([tails_k[:, (j - 1) * t : j * t], kj], dim=1)
                vj = torch.cat([tails_v[:, (j - 1) * t : j * t], vj], dim=1)
            k0, _ = window_keys(j * c, (j + 1) * c - 1, self.window)
            qj = q[:, own].transpose(1, 2)
            kj, vj = _repeat_kv(kj, q).transpose(1, 2), _repeat_kv(vj, q).transpose(1, 2)
            out = mask.attend(qj, kj, vj, (own.start, own.stop), window=self.window, sinks=sinks, key_start=k0)
            outs.append(out.transpose(1, 2))
        return torch.cat(outs, dim=1)


def _repeat_kv(kv: Tensor, q: Tensor) -> Tensor:
    """Grouped-query attention, as the plain core does (after the gather: kv heads travel)."""
    n_rep = q.shape[2] // kv.shape[2]
    return kv.repeat_interleave(n_rep, dim=2) if n_rep > 1 else kv


def _gather_replicated(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """:func:`all_gather_sequence` of ``t``, in global order; a tensor-parallel ``Replicate`` DTensor (MLA's latent
    under tp) travels as its local tensor and comes back as one, its gradient kept a ``Partial`` sum over tp (each
    rank's heads use it), as the ``Latent`` style hands it on."""
    from torch.distributed.tensor import DTensor, Partial

    from titanlike.parallel.dtensor_grad import from_local

    if not isinstance(t, DTensor):
        return reorder_gathered(all_gather_sequence(t, mesh), mesh.size())
    partial = (Partial(),) * t.device_mesh.ndim
    local = reorder_gathered(all_gather_sequence(t.to_local(grad_placements=partial), mesh), mesh.size())
    return from_local(local, t.device_mesh, t.placements, partial)


class ContextParallelLatentAttention(nn.Module):
    """Context-parallel :class:`~titanlike.models.decoder.LatentAttentionCore` over ``cp_mesh``: the latent
    (``kv_lora_rank`` numbers per token) and the shared RoPE key (``qk_rope_head_dim``: 512 + 64 = 576 for
    DeepSeek-V3) are all-gathered instead of the per-head keys and values (2 x 128 x 192 = 49152 for V3), and expanded
    locally by the model's ``expand`` over the whole gathered sequence; then each local query chunk attends as in
    :class:`ContextParallelAttention` (causal, or the block-causal mask). Backward: the gathered latent's and key's
    gradients are reduce-scattered (the expansion's weight gradients stay local: FSDP / the data-parallel
    reduction over ``dp x cp`` sums them). Every cp rank of the mesh must call it."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, chunks={chunk_ids(self.cp, self.rank)}, gathers the latent"

    def forward(self, q: Tensor, latent: Tensor, k_rope: Tensor, expand, mask: DocumentMask | None = None) -> Tensor:
        cp, c = self.cp, q.shape[1] // 2
        k_all, v_all = expand(_gather_replicated(latent, self.cp_mesh), _gather_replicated(k_rope, self.cp_mesh))
        kt, vt = k_all.transpose(1, 2), v_all.transpose(1, 2)
        outs = []
        for half, j in enumerate(chunk_ids(cp, self.rank)):
            qj = q[:, half * c : (half + 1) * c].transpose(1, 2)
            kj, vj = kt[:, :, : (j + 1) * c], vt[:, :, : (j + 1) * c]
            if mask is None:
                outs.append(chunk_attention(qj, kj, vj).transpose(1, 2))
            else:
                outs.append(mask.attend(qj, kj, vj, rows=(half * c, (half + 1) * c)).transpose(1, 2))
        return torch.cat(outs, dim=1)


# ---------------------------------------------------------------------------------------------- all-to-all (Ulysses)
METHODS = ("allgather", "alltoall", "ring", "hybrid")  # parallelism.context_parallel_method


def ulysses_kv_heads(n_heads: int, n_kv_heads: int, cp: int) -> int:
    """The kv heads an all-to-all layer sends: ``n_kv_heads`` when cp divides them, else each repeated to
    ``lcm(n_kv_heads, cp)`` (a multiple of cp that divides ``n_heads``: every query head group keeps its kv head).
    ``n_heads`` (this tp rank's) must be divisible by cp (the layout rule ``cp_heads``)."""
    import math

    if n_heads % cp:
        raise ValueError(
            f"context_parallel_method alltoall: the {n_heads} query heads of a tp rank are not divisible by cp {cp}; "
            f"use context_parallel_method allgather, or a cp degree that divides them"
        )
    return n_kv_heads if n_kv_heads % cp == 0 else math.lcm(n_kv_heads, cp)


def _split_heads(x: Tensor, cp: int) -> Tensor:
    """(batch, s, heads, d) -> (cp, batch, s, heads / cp, d): head group g (contiguous heads) goes to cp rank g."""
    b, s, h, d = x.shape
    return x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()


def _join_heads(t: Tensor) -> Tensor:
    """(cp, batch, s, heads / cp, d), index = the head group (the cp rank it came from) -> (batch, s, heads, d)."""
    cp, b, s, hc, d = t.shape
    return t.permute(1, 2, 0, 3, 4).reshape(b, s, cp * hc, d)


def _all_to_all(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """Equal-split all-to-all along dim 0 over ``mesh`` (autograd: the backward is the reverse all-to-all)."""
    shape = t.shape
    out = _wait(funcol.all_to_all_single_autograd(t.reshape(shape[0] * shape[1], *shape[2:]), None, None, mesh))
    return out.view(shape)


def group_to_heads(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """The all-to-all over ``mesh`` (``n`` ranks): this rank's tokens of every head (batch, s, heads, d) -> every
    rank's tokens of this rank's head group (batch, n s, heads / n, d), in rank order (rank 0's tokens, rank 1's,
    ...)."""
    n = mesh.size()
    got = _all_to_all(_split_heads(x, n), mesh)  # (n, b, s, hc, d): index = the source rank (its two chunks)
    n_, b, s, hc, d = got.shape
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * s, hc, d)


def heads_to_group(y: Tensor, mesh: DeviceMesh) -> Tensor:
    """The inverse of :func:`group_to_heads`: (batch, n s, heads / n, d) in rank order -> this rank's tokens of
    every head (batch, s, heads, d)."""
    n = mesh.size()
    b, t, hc, d = y.shape
    send = y.view(b, n, t // n, hc, d).transpose(0, 1).contiguous()  # (n, b, s, hc, d): to rank r
    return _join_heads(_all_to_all(send, mesh))


def seq_to_heads(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Ulysses' first all-to-all: this rank's tokens of every head (batch, s, heads, d) -> every token of this rank's
    head group (batch, cp s, heads / cp, d), in natural sequence order (the load-balanced chunks put back)."""
    return reorder_gathered(group_to_heads(x, mesh), mesh.size())


def heads_to_seq(y: Tensor, mesh: DeviceMesh) -> Tensor:
    """Ulysses' second all-to-all, the inverse of :func:`seq_to_heads`: (batch, S, heads / cp, d) in natural order
    -> this rank's chunks of every head (batch, S / cp, heads, d)."""
    cp = mesh.size()
    ranked = torch.cat([cp_shard(y, cp, r) for r in range(cp)], dim=1)  # rank r's chunks at [r s, (r + 1) s)
    return heads_to_group(ranked, mesh)


def _whole_mask(mask: DocumentMask | None, mesh: DeviceMesh, seq_len: int, batch: int) -> DocumentMask | None:
    """The mask of the whole sequence (every position a query) from this rank's ``mask``: its documents' starts
    all-gathered once per forward (kept on ``mask``: every layer and the recomputation of AC reuse it); a causal
    mask of the whole sequence where the seam needs one without documents (a window, sinks)."""
    if mask is None:
        return None
    key = ("cp_whole_sequence", seq_len)
    if key not in mask._cache:
        device = mask.starts.device
        if mask.documents:
            starts = gather_window(mask.starts, mesh)
        else:
            starts = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
        mask._cache[key] = _whole_sequence_mask(starts, torch.arange(seq_len, device=device), mask)
    return mask._cache[key]


def _whole_sequence_mask(starts: Tensor, positions: Tensor, local: DocumentMask) -> DocumentMask:
    """The :class:`DocumentMask` of the whole sequence (``positions`` 0 .. S-1, ``starts`` (batch, S)) with
    ``local``'s backend, windows and documents flag, its masks built at their first ``attend`` (cached on it as
    usual) rather than at construction: the constructor reads the positions on the host to find their contiguous
    runs, which a compiled block cannot do without a graph break (an error under ``fullgraph``); here the one run
    is known. Built inside the attention seam, so inside a compiled block."""
    whole = DocumentMask.__new__(DocumentMask)
    whole.starts, whole.positions, whole.backend = starts, positions, local.backend
    whole.windows, whole.documents, whole._cache = local.windows, local.documents, {}
    return whole


def _head_slice(t: Tensor, cp: int, rank: int) -> Tensor:
    """This cp rank's head group of a per-head tensor (the sinks, (heads,))."""
    n = t.shape[0] // cp
    return t[rank * n : (rank + 1) * n]


class UlyssesAttention(nn.Module):
    """Context-parallel attention by all-to-all over heads (DeepSpeed-Ulysses), same interface as
    :class:`ContextParallelAttention`: ``q (batch, s, heads, d)``, ``k, v (batch, s, kv_heads, d)`` of this rank's
    ``s = S / cp`` tokens (its two load-balanced chunks). One all-to-all each turns the sequence split of q, k, v
    into a head split (every token of ``heads / cp`` heads, in natural order); the plain seam's attention runs over
    the whole sequence (causal, the document mask, the window, this head group's sinks); one all-to-all turns the
    output back. Backward: the reverse all-to-alls (autograd). Kv heads that cp does not divide are repeated first
    (:func:`ulysses_kv_heads`). Every cp rank of the mesh must call it."""

    attention_seam = True

    def __init__(self, cp_mesh: DeviceMesh, window: int | None = None, sinks: bool = False):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, all-to-all over heads, window={self.window}"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        kv_heads = ulysses_kv_heads(q.shape[2], k.shape[2], self.cp)
        if kv_heads != k.shape[2]:
            k = k.repeat_interleave(kv_heads // k.shape[2], dim=2)
            v = v.repeat_interleave(kv_heads // v.shape[2], dim=2)
        qh, kh, vh = (seq_to_heads(t, self.cp_mesh) for t in (q, k, v))
        whole = _whole_mask(mask, self.cp_mesh, qh.shape[1], q.shape[0])
        own_sinks = None if sinks is None else _head_slice(sinks, self.cp, self.rank)
        out = AttentionCore.forward(self, qh, kh, vh, whole, own_sinks)
        return heads_to_seq(out, self.cp_mesh)


class UlyssesLatentAttention(nn.Module):
    """:class:`UlyssesAttention` for the latent seam (multi-head latent attention): the latent is expanded locally
    by the model's up-projection (this rank's tokens), then the per-head queries, keys and values travel by
    all-to-all as for any attention (an all-to-all cannot split a latent shared by every head)."""

    window, sinks = None, False

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, all-to-all over heads of the expanded latent"

    def forward(self, q: Tensor, latent: Tensor, k_rope: Tensor, expand, mask: DocumentMask | None = None) -> Tensor:
        k, v = expand(latent, k_rope)
        ulysses_kv_heads(q.shape[2], k.shape[2], self.cp)  # every head its own key and value: the check only
        qh, kh, vh = (seq_to_heads(t, self.cp_mesh) for t in (q, k, v))
        whole = _whole_mask(mask, self.cp_mesh, qh.shape[1], q.shape[0])
        return heads_to_seq(AttentionCore.forward(self, qh, kh, vh, whole), self.cp_mesh)


# ---------------------------------------------------------------------------------------------- hybrid
def hybrid_layout(a2a: int):
    """The chunks a ring rank holds under ``hybrid``: ring rank ``g`` is the all-to-all group of cp ranks
    ``g a2a .. (g + 1) a2a - 1`` (all-to-all innermost), and after the group's all-to-all every rank of it holds the
    two load-balanced chunks of each of them, in rank order. A ``layout(ring_size, ring_rank)`` for
    ``titanlike.parallel.ring_attention`` (``cp = ring_size x a2a``)."""

    def layout(ring_size: int, g: int) -> tuple[int, ...]:
        return tuple(j for i in range(a2a) for j in chunk_ids(ring_size * a2a, g * a2a + i))

    return layout


def hybrid_meshes(cp_mesh: DeviceMesh, a2a: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(ring mesh, all-to-all mesh) of the 1-D cp mesh split into ``(cp / a2a, a2a)``, the all-to-all innermost
    (neighbouring cp ranks, as tp is innermost overall: the all-to-all's traffic stays on the closest links)."""
    cp = cp_mesh.size()
    if a2a <= 1 or a2a >= cp or cp % a2a:
        raise ValueError(
            f"context_parallel_method hybrid: context_parallel_a2a_degree {a2a} must divide cp {cp} and lie strictly "
            f"between 1 and cp (a2a 1 is the ring method, a2a = cp the alltoall method)"
        )
    split = cp_mesh._unflatten(0, (cp // a2a, a2a), ("cp_ring", "cp_a2a"))
    return split["cp_ring"], split["cp_a2a"]


def _group_starts(mask: DocumentMask | None, mesh: DeviceMesh) -> Tensor | None:
    """The document starts of every token of this rank's all-to-all group, in rank order (the queries' rows after
    :func:`group_to_heads`): one all-gather per forward, kept on ``mask`` (every layer and AC's recomputation reuse
    it); None without documents."""
    if mask is None or not mask.documents:
        return None
    key = ("cp_hybrid_group_starts", mesh.size())
    if key not in mask._cache:
        mask._cache[key] = _gather_seq(mask.starts, mesh)
    return mask._cache[key]


class HybridAttention(nn.Module):
    """Context-parallel attention by all-to-all inside groups of ``a2a`` cp ranks and a ring across the groups
    (Megatron-Core's hierarchical a2a + p2p), same interface as :class:`ContextParallelAttention`. The all-to-all
    over the group (:func:`group_to_heads`) gives each rank ``heads / a2a`` heads of the group's ``2 a2a``
    load-balanced chunks (kv heads the group size does not divide repeated first, :func:`ulysses_kv_heads`); the
    ring over the ``cp / a2a`` ranks holding the same head group (``titanlike.parallel.ring_attention``,
    :func:`hybrid_layout`) passes those keys / values around, masks from the chunks' global positions and the
    group's document starts; the reverse all-to-all turns the output back. Sinks: this rank's head group's.
    ``meshes``: (ring mesh, all-to-all mesh), :func:`hybrid_meshes`. Every cp rank must call it."""

    attention_seam = True

    def __init__(self, meshes: tuple[DeviceMesh, DeviceMesh], window: int | None = None, sinks: bool = False):
        super().__init__()
        self.ring_mesh, self.a2a_mesh = meshes
        self.a2a, self.a2a_rank = self.a2a_mesh.size(), self.a2a_mesh.get_local_rank()
        self.layout = hybrid_layout(self.a2a)
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return f"a2a={self.a2a} x ring={self.ring_mesh.size()}, window={self.window}"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        kv_heads = ulysses_kv_heads(q.shape[2], k.shape[2], self.a2a)
        if kv_heads != k.shape[2]:
            k = k.repeat_interleave(kv_heads // k.shape[2], dim=2)
            v = v.repeat_interleave(kv_heads // v.shape[2], dim=2)
        qh, kh, vh = (group_to_heads(t, self.a2a_mesh).transpose(1, 2) for t in (q, k, v))
        own_sinks = None if sinks is None else _head_slice(sinks, self.a2a, self.a2a_rank)
        starts = _group_starts(mask, self.a2a_mesh)
        out = ring_attention(qh, kh, vh, self.ring_mesh, self.layout, starts, self.window, own_sinks)
        return heads_to_group(out.transpose(1, 2), self.a2a_mesh)


class HybridLatentAttention(nn.Module):
    """:class:`HybridAttention` for the latent seam (multi-head latent attention): the latent expanded locally by the
    model's up-projection (this rank's tokens), then the per-head queries, keys and values go through the group's
    all-to-all and the ring across groups."""

    window, sinks = None, False

    def __init__(self, meshes: tuple[DeviceMesh, DeviceMesh]):
        super().__init__()
        self.ring_mesh, self.a2a_mesh = meshes
        self.a2a = self.a2a_mesh.size()
        self.layout = hybrid_layout(self.a2a)

    def extra_repr(self) -> str:
        return f"a2a={self.a2a} x ring={self.ring_mesh.size()} over the expanded latent's heads"

    def forward(self, q: Tensor, latent: Tensor, k_rope: Tensor, expand, mask: DocumentMask | None = None) -> Tensor:
        k, v = expand(latent, k_rope)
        ulysses_kv_heads(q.shape[2], k.shape[2], self.a2a)  # every head its own key and value: the check only
        qh, kh, vh = (group_to_heads(t, self.a2a_mesh).transpose(1, 2) for t in (q, k, v))
        out = ring_attention(qh, kh, vh, self.ring_mesh, self.layout, _group_starts(mask, self.a2a_mesh))
        return heads_to_group(out.transpose(1, 2), self.a2a_mesh)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``q`` (batch, heads, c, d), the last ``c`` positions, over ``k, v`` (batch, heads, n, d),
    positions ``0 .. n-1`` (the causal mask aligned to the bottom right). No ``c x n`` mask is materialised:

    * CUDA: SDPA with ``causal_lower_right`` (flash / memory-efficient kernels take the bottom-right alignment);
    * CPU: torch's flash kernel twice, the ``n - c`` earlier keys without a mask and the last ``c`` with the square
      causal mask, merged by their log-sum-exps (:class:`_TwoBlockAttentionCPU`); anything else (values of another
      head dim than q / k, MLA's: the CPU flash kernel refuses them, torch 2.13): the explicit mask.
    """
    c, n = q.shape[2], k.shape[2]
    if q.device.type == "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, n))
    if q.device.type == "cpu" and _cpu_flash is not None and v.shape[-1] == q.shape[-1]:
        if n == c:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _TwoBlockAttentionCPU.apply(q, k[:, :, : n - c], v[:, :, : n - c], k[:, :, n - c :], v[:, :, n - c :])
    mask = torch.ones(c, n, dtype=torch.bool, device=q.device).tril(n - c)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_cpu_flash_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _TwoBlockAttentionCPU(torch.autograd.Function):
    """softmax over [past keys (all visible) | diagonal keys (causal)], exact, from two flash calls.

    Forward: ``o_p, l_p`` over the past block, ``o_d, l_d`` over the diagonal block; ``l = logaddexp(l_p, l_d)``,
    ``o = exp(l_p - l) o_p + exp(l_d - l) o_d``. Backward: the flash backward of each block with the merged ``o`` and
    ``l`` gives that block's exact share of the gradients (its probabilities are ``exp(s - l)``), as in ring
    attention. Saves ``q``, the keys / values (views of the gathered ones), ``o`` and ``l``: no ``c x n`` tensor.
    """

    @staticmethod
    def forward(ctx, q, k_past, v_past, k_diag, v_diag):
        o_d, l_d = _cpu_flash(q, k_diag, v_diag, 0.0, True)
        o_p, l_p = _cpu_flash(q, k_past, v_past, 0.0, False)
        lse = torch.logaddexp(l_p, l_d)
        out = (torch.exp(l_p - lse).unsqueeze(-1) * o_p + torch.exp(l_d - lse).unsqueeze(-1) * o_d).to(q.dtype)
        ctx.save_for_backward(q, k_past, v_past, k_diag, v_diag, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_past, v_past, k_diag, v_diag, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_d, dk_d, dv_d = _cpu_flash_bwd(grad, q, k_diag, v_diag, out, lse, 0.0, True)
        dq_p, dk_p, dv_p = _cpu_flash_bwd(grad, q, k_past, v_past, out, lse, 0.0, False)
        return dq_p + dq_d, dk_p, dv_p, dk_d, dv_d


def reorder_gathered(t: Tensor, cp: int) -> Tensor:
    """Rank-ordered gather (rank 0's chunks, rank 1's, ...) -> global sequence order."""
    return cp_unshard(t, cp, dim=1)


# ---------------------------------------------------------------------------------------------- positions
def _global_positions(seq_len: int, cp: int, rank: int, device) -> Tensor:
    return cp_positions(seq_len, cp, rank, device)


class ContextParallelPositions(nn.Module):
    """The position seam under context parallelism: the global positions of this cp rank's ``s = seq_len / cp``
    tokens (chunks ``r`` and ``2 cp - 1 - r``), from which the model looks up its RoPE rows or position
    embeddings."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}"

    def forward(self, x: Tensor) -> Tensor:
        return _global_positions(x.shape[1] * self.cp, self.cp, self.rank, x.device)  # x.shape: DTensor or not


class ContextParallelWindow(nn.Module):
    """The window seam under context parallelism: a per-token tensor (token ids) of every cp rank gathered and put
    in global order, (batch, seq of the whole window). Integers, no gradient: one all-gather."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp_mesh = cp_mesh

    def forward(self, t: Tensor) -> Tensor:
        return gather_window(t, self.cp_mesh)


def gather_window(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """Every cp rank's ``t`` (batch, local seq), no gradient, in global sequence order."""
    return reorder_gathered(_gather_seq(t, mesh), mesh.size())


def cp_shift_labels(cp_mesh: DeviceMesh):
    """``ScaledLoss.shift_labels`` under context parallelism: the labels of MTP depth k are the whole window's
    labels shifted by k (a rank's two chunks are not contiguous), cut back to this rank's chunks."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def shift(labels: Tensor, k: int) -> Tensor:
        return cp_shard(shift_labels(gather_window(labels, cp_mesh), k), cp, rank)

    return shift


# what apply_cp puts in place of the seams: a model holding any of them has been given context parallelism already
_CP_MODULES = (
    ContextParallelAttention,
    ContextParallelLatentAttention,
    UlyssesAttention,
    UlyssesLatentAttention,
    RingAttention,
    RingLatentAttention,
    HybridAttention,
    HybridLatentAttention,
    ContextParallelPositions,
    ContextParallelGatedDelta,
    ContextParallelShortConv,
)


def apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, *, positions: bool = True, method: str = "allgather", a2a_degree: int = 1
) -> nn.Module:
    """Context parallelism over ``cp_mesh`` (1-D), in place; returns ``model``.

    Every attention seam (``titanlike.models.decoder.AttentionCore``, called as ``core(q, k, v)``) becomes a
    :class:`ContextParallelAttention` (a ``LatentAttentionCore``: a :class:`ContextParallelLatentAttention`), every
    position seam (``titanlike.models.decoder.Positions``) a :class:`ContextParallelPositions`, every
    linear-attention seam (``titanlike.models.linear_attention``: ``GatedDeltaCore``, ``ShortConvCore``) its
    state-passing counterpart (``titanlike.parallel.state_passing``). A module without an attention seam is refused
    (its attention would see only this rank's tokens); so is one without a position seam unless ``positions=False``
    (the model has no positions, or feeds ``cp_positions`` to its position lookups itself). ``method``
    (``parallelism.context_parallel_method``): "allgather" (K/V all-gathered, the cores above), "alltoall" (the
    softmax seams become :class:`UlyssesAttention` / :class:`UlyssesLatentAttention`: all-to-all over heads) or
    "ring" (``titanlike.parallel.ring_attention``: K/V blocks passed around the cp group) or "hybrid" (all-to-all
    inside groups of ``a2a_degree`` ranks, a ring across them: :class:`HybridAttention`); the linear-attention
    seams pass state over the whole cp mesh whatever the method. Call after tensor
    parallelism and before activation checkpointing / compile / FSDP; the batches must be cut with :func:`cp_shard`.
    """
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp needs a 1-D cp mesh, got {cp_mesh}")
    if method not in METHODS:
        raise ValueError(f"apply_cp: context_parallel_method {method!r} is not one of {', '.join(METHODS)}")
    cores, seams, windows, linear = [], [], [], []
    for module in model.modules():
        for child_name, child in module.named_children():
            if isinstance(child, (AttentionCore, LatentAttentionCore)):
                cores.append((module, child_name))
            elif isinstance(child, Positions):
                seams.append((module, child_name))
            elif isinstance(child, SequenceWindow):
                windows.append((module, child_name))
            elif isinstance(child, (GatedDeltaCore, ShortConvCore)):
                linear.append((module, child_name, child))
    already = any(isinstance(m, _CP_MODULES) for m in model.modules())
    if not cores and not linear and not already:
        raise ValueError(
            f"apply_cp: {type(model).__name__} has no attention seam (a titanlike.models.decoder.AttentionCore "
            f"module called as core(q, k, v)), so each cp rank would attend over its own tokens only; route its "
            f"attention through one, or keep context_parallel_degree 1"
        )
    if positions and not seams and not already:
        raise ValueError(
            f"apply_cp: {type(model).__name__} has no position seam (a titanlike.models.decoder.Positions module "
            f"its RoPE / position lookups read), so its positions would restart on every cp rank; give it one, or "
            f"pass positions=False if it has no positions or feeds cp_positions to them itself"
        )
    meshes = hybrid_meshes(cp_mesh, a2a_degree) if method == "hybrid" and cores else None
    for owner, child_name in cores:
        setattr(owner, child_name, _cp_attention_core(getattr(owner, child_name), cp_mesh, method, meshes))
    for owner, child_name in seams:
        setattr(owner, child_name, ContextParallelPositions(cp_mesh))
    for owner, child_name in windows:
        setattr(owner, child_name, ContextParallelWindow(cp_mesh))
    for owner, child_name, child in linear:  # linear attention: state passing (titanlike.parallel.state_passing)
        stateful = isinstance(child, GatedDeltaCore)
        setattr(
            owner,
            child_name,
            ContextParallelGatedDelta(cp_mesh, child.chunk_size) if stateful else ContextParallelShortConv(cp_mesh),
        )
    return model


def _cp_attention_core(core: nn.Module, cp_mesh: DeviceMesh, method: str, meshes) -> nn.Module:
    """The context-parallel counterpart of one softmax attention seam (a ``LatentAttentionCore``: of the latent
    seam) under ``method``, keeping its window and sinks; ``meshes``: hybrid's (ring, all-to-all) meshes."""
    if method == "hybrid":
        latent = isinstance(core, LatentAttentionCore)
        return HybridLatentAttention(meshes) if latent else HybridAttention(meshes, core.window, core.sinks)
    if isinstance(core, LatentAttentionCore):
        if method == "alltoall":
            return UlyssesLatentAttention(cp_mesh)
        if method == "ring":
            return RingLatentAttention(cp_mesh, chunk_ids)
        return ContextParallelLatentAttention(cp_mesh)
    if method == "alltoall":
        return UlyssesAttention(cp_mesh, core.window, core.sinks)
    if method == "ring":
        return RingAttention(cp_mesh, chunk_ids, core.window, core.sinks)
    return ContextParallelAttention(cp_mesh, window=core.window, sinks=core.sinks)
