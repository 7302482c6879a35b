"""Context parallelism of linear attention by state passing: what crosses the cp group is a fixed-size state summary
per piece, not the keys and values of the sequence.

``titanlike.parallel.context_parallel.apply_cp`` swaps the linear-attention seams of ``titanlike.models
.linear_attention`` for the two modules here (the softmax-attention seams keep their K/V all-gather), on the same
load-balanced layout: the sequence in ``2 cp`` chunks, cp rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``
(``chunks``), so a rank holds two pieces that are not adjacent and the pieces' true order is not the ranks' order.

:class:`ContextParallelGatedDelta` (the gated delta rule):

1. each of the rank's two pieces runs from a zero state and returns its affine map on the state entering it
   (``titanlike.models.linear_attention.state_affine``: the zero-state outputs, the per-token correction rows, the
   leaving state ``M S + B``);
2. the maps ``(B, M)`` of the two pieces, ``(batch, v_heads, dk, dv + dk)`` each, are all-gathered over the cp group
   (one ``all_gather_into_tensor`` per layer; its backward a ``reduce_scatter_tensor``): ``2 cp`` maps, put back
   into true sequence order (:func:`true_order`, whatever the placement);
3. every rank scans them in that order from the zero state (``S_{j+1} = M_j S_j + B_j``, :func:`entering_states`),
   a few (dk x dk) matmuls per chunk, and corrects its outputs for the state entering each of its pieces
   (``o_t += S^T corr_t``).

Document starts reset the state inside a piece and across pieces: the masks of the piece's run use the tokens'
global positions and document starts (a piece whose last document began inside it has ``M = 0`` for the tokens of
that document, so no earlier state reaches them). The message is ``2 x batch x v_heads x dk x (dv + dk)`` numbers
per layer and rank, independent of the sequence length; the scan runs redundantly on every rank (an all-gather and
``2 cp`` small matmuls instead of ``cp - 1`` dependent point-to-point hops).

:class:`ContextParallelShortConv` (the short causal conv): each piece's first ``kernel - 1`` taps read the inputs
before it, which live on another rank (or on this one: under the load-balanced split chunk ``cp - 1`` precedes
chunk ``cp``). Every rank all-gathers the last ``min(kernel - 1, piece)`` inputs of each of its pieces (the halo),
orders them by chunk, and gives each piece the last ``kernel - 1`` inputs before it (several earlier pieces when the
pieces are shorter than the kernel); document starts mask the halo like any tap.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titanlike.models.linear_attention import conv_taps, state_affine
from titanlike.models.masking import DocumentMask

__all__ = [
    "ContextParallelGatedDelta",
    "ContextParallelShortConv",
    "entering_states",
    "halo_before",
    "state_message_numel",
    "true_order",
]

_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _wait(t: Tensor) -> Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 over the cp mesh; backward: reduce-scatter (every rank used every message)."""

    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh) -> Tensor:
        ctx.mesh = mesh
        return _wait(_ALL_GATHER(x.contiguous(), 0, mesh))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _wait(_REDUCE_SCATTER(grad.contiguous(), "sum", 0, ctx.mesh)), None


def gather_pieces(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """(2, ...) this rank's two pieces' messages -> (2 cp, ...) every rank's, in rank order."""
    return _AllGather.apply(x, mesh)


def true_order(gathered: Tensor, chunks_of_rank: list[tuple[int, int]]) -> Tensor:
    """Rank-ordered messages (rank 0's two pieces, rank 1's, ...) -> sequence order (chunk 0, 1, ...)."""
    where = {j: 2 * r + half for r, pair in enumerate(chunks_of_rank) for half, j in enumerate(pair)}
    return gathered[[where[j] for j in range(len(where))]]


def entering_states(maps: Tensor, dv: int, upto: int) -> list[Tensor]:
    """The state entering chunks ``0 .. upto`` from the maps in sequence order ((2 cp, b, h, dk, dv + dk): ``B`` then
    ``M``): the scan ``S_0 = 0``, ``S_{j+1} = M_j S_j + B_j``."""
    state = torch.zeros_like(maps[0, ..., :dv])
    out = []
    for j in range(upto + 1):
        out.append(state)
        state = maps[j, ..., dv:] @ state + maps[j, ..., :dv]
    return out


def state_message_numel(batch: int, v_heads: int, dk: int, dv: int) -> int:
    """Numbers one cp rank sends per linear-attention layer and forward: two pieces' ``(B, M)`` maps."""
    return 2 * batch * v_heads * dk * (dv + dk)


def _layout(cp_mesh: DeviceMesh) -> tuple[int, int, list[tuple[int, int]]]:
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    return cp, rank, [(r, 2 * cp - 1 - r) for r in range(cp)]


def _halves(mask: DocumentMask | None, c: int):
    """(starts, positions) of each of the rank's two pieces (None, None without a mask)."""
    if mask is None:
        return [(None, None), (None, None)]
    return [(mask.starts[:, h * c : (h + 1) * c], mask.positions[h * c : (h + 1) * c]) for h in (0, 1)]


class ContextParallelGatedDelta(nn.Module):
    """The gated-delta seam under context parallelism (module docstring): same interface as
    ``GatedDeltaCore``, on this rank's two pieces; every cp rank of the mesh must call it."""

    def __init__(self, cp_mesh: DeviceMesh, chunk_size: int = 64):
        super().__init__()
        self.cp_mesh, self.chunk_size = cp_mesh, chunk_size
        self.cp, self.rank, self.chunks_of_rank = _layout(cp_mesh)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, chunks={self.chunks_of_rank[self.rank]}, chunk_size={self.chunk_size}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mask: DocumentMask | None = None):
        c, dv = q.shape[1] // 2, v.shape[-1]
        pieces, maps = [], []
        for h, (starts, positions) in enumerate(_halves(mask, c)):
            part = [t[:, h * c : (h + 1) * c] for t in (q, k, v, g, beta)]
            out0, corr, b, m = state_affine(*part, chunk_size=self.chunk_size, starts=starts, positions=positions)
            pieces.append((out0, corr))
            maps.append(torch.cat([b, m], dim=-1))
        ordered = true_order(gather_pieces(torch.stack(maps), self.cp_mesh), self.chunks_of_rank)
        mine = self.chunks_of_rank[self.rank]
        states = entering_states(ordered, dv, max(mine))
        outs = [
            (out0 + torch.einsum("bshk,bhkv->bshv", corr, states[j])).to(v.dtype)
            for (out0, corr), j in zip(pieces, mine)
        ]
        return torch.cat(outs, dim=1)


def halo_before(tails: Tensor, chunk: int, kernel: int) -> Tensor | None:
    """The last ``kernel - 1`` inputs before chunk ``chunk`` from every chunk's tail in sequence order ((2 cp, b, t,
    C)), zero-padded at the front; None for chunk 0 (zeros)."""
    if chunk == 0:
        return None
    before = torch.cat(list(tails[:chunk]), dim=1)[:, -(kernel - 1) :]
    short = kernel - 1 - before.shape[1]
    if short > 0:
        before = torch.cat([before.new_zeros(before.shape[0], short, before.shape[2]), before], dim=1)
    return before


class ContextParallelShortConv(nn.Module):
    """The short-conv seam under context parallelism: the taps of this rank's two pieces, each reading its halo
    (the inputs before it, from whichever rank holds them); every cp rank of the mesh must call it."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp, self.rank, self.chunks_of_rank = _layout(cp_mesh)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, chunks={self.chunks_of_rank[self.rank]}"

    def forward(self, x: Tensor, kernel: int, mask: DocumentMask | None = None) -> Tensor:
        c = x.shape[1] // 2
        t = min(kernel - 1, c)
        if t == 0:
            return conv_taps(x, kernel)
        tails = torch.stack([x[:, (h + 1) * c - t : (h + 1) * c] for h in (0, 1)])
        ordered = true_order(gather_pieces(tails, self.cp_mesh), self.chunks_of_rank)
        taps = []
        for h, ((starts, positions), j) in enumerate(zip(_halves(mask, c), self.chunks_of_rank[self.rank])):
            halo = halo_before(ordered, j, kernel)
            taps.append(conv_taps(x[:, h * c : (h + 1) * c], kernel, starts, positions, halo))
        return torch.cat(taps, dim=1)
