"""Ring attention: context parallelism that passes key / value blocks around the cp group.

Each cp rank holds its two load-balanced chunks (``titanlike.parallel.context_parallel``: chunks ``r`` and
``2 cp - 1 - r`` of ``C`` tokens each) of the queries, keys and values. In ``cp`` steps every rank's keys and values
visit every rank: at step ``i`` rank ``r`` holds those of rank ``(r - i) mod cp`` and, while it computes with them,
sends them on to rank ``r + 1`` and receives the next ones from ``r - 1`` (the transfer posted before the compute:
they overlap where the backend is asynchronous). Each of its two query chunks attends to each of the two key chunks
it can see (a chunk after it is skipped, so is one wholly outside a sliding window) and the block's result, an
output and its rows' log-sum-exps, is merged into the running one (online softmax):
``lse = logaddexp(lse, lse_b)``, ``out = e^(lse_old - lse) out + e^(lse_b - lse) out_b``. No rank ever holds more
than its own and one visiting pair of chunks: ``2 x 2 C`` tokens of K and V instead of the whole sequence's.

Backward (a custom autograd function): the keys and values go around the ring again, and with them the
accumulated gradients of their keys and values; each rank adds its queries' share (the block's probabilities
recomputed from the final log-sum-exp: ``P = exp(q k^T / sqrt(d) - lse)``, ``dS = P (dO v^T - D)`` with
``D = rowsum(dO o) - dlse``) and passes them on; after ``cp`` hops every rank holds the sum over all queries of its
own keys' and values' gradients. The queries' gradient stays local.

Masks: causal (global positions), the document mask (each query row's document start, cut like the inputs) and the
sliding window, all from the global positions of the two chunks: no extra collective. Sinks (one logit per head) are
merged into the final log-sum-exp outside the function (``out * sigmoid(lse - sink)``, autograd reaching the
sink). The blocks are computed explicitly (``C x C`` scores per pair, float64-exact): the CPU path; a CUDA port would
call the flash kernels' forward / backward with log-sum-exp per block, as the two-block CPU path of the all-gather
core does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titanlike.parallel.p2p import exchange_start, exchange_wait

__all__ = ["RingAttention", "RingLatentAttention", "merge", "passed_on", "ring_attention", "ring_steps"]


def _is_shape_only(t: Tensor) -> bool:
    """Meta tensors (a pipeline stage's shape inference) and fake ones (the planner's probe): no values to send."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor)


class _Ring:
    """The cp group's ring: post the send of ``tensors`` to the next rank and the receive of as many from the
    previous one; :meth:`wait` returns what arrived. The exchange is ``titanlike.parallel.p2p``'s (traced: opaque
    custom ops, so a compiled block holds the ring whole)."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        cp, r = mesh.size(), mesh.get_local_rank()
        self.next = dist.get_global_rank(self.group, (r + 1) % cp)
        self.prev = dist.get_global_rank(self.group, (r - 1) % cp)

    def start(self, tensors: list[Tensor]):
        if _is_shape_only(tensors[0]):
            return None, [t.clone() for t in tensors]
        return exchange_start(tensors, self.group, self.next, self.prev), tensors

    @staticmethod
    def wait(pending) -> list[Tensor]:
        exchange, sent = pending
        return sent if exchange is None else exchange_wait(exchange, sent)


def ring_steps(cp: int) -> range:
    """The ring's steps: every rank's keys and values visit every rank once."""
    return range(cp)


def passed_on(kept: list[Tensor], arrived: list[Tensor]) -> list[Tensor]:
    """The key / value gradients a rank carries on after a backward hop: the ones that arrived (``kept``: what it
    sent; the gate's mutation keeps those instead)."""
    return arrived


def merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: the running ``out`` (rows' outputs) and ``lse`` (their log-sum-exps) merged with a block's.
    A row the block does not reach (``lse_b = -inf``) keeps its own; a row neither reaches yet (a rank holding more
    than two chunks, :mod:`hybrid <titanlike.parallel.context_parallel>`'s groups, meets earlier blocks before the
    diagonal one) stays at output 0, log-sum-exp ``-inf``."""
    new = torch.logaddexp(lse, lse_b)
    at = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # a row neither block reaches yet stays (0, -inf)
    return torch.exp(lse - at).unsqueeze(-1) * out + torch.exp(lse_b - at).unsqueeze(-1) * out_b, new


class _Blocks:
    """The block masks of one call: query chunk ``jq`` (local half ``hq``) against key chunk ``jk``, from the global
    positions, the query rows' document starts and the window."""

    def __init__(self, chunks, c: int, starts: Tensor | None, window: int | None, device):
        self.chunks, self.c, self.starts, self.window, self.device = chunks, c, starts, window, device

    def visible(self, jq: int, jk: int) -> bool:
        """Whether any query of chunk ``jq`` can see a key of chunk ``jk`` (causal: ``jk <= jq``; the window:
        the chunk's last key within ``window`` of its first query)."""
        if jk > jq:
            return False
        return self.window is None or (jk + 1) * self.c - 1 > jq * self.c - self.window

    def keep(self, hq: int, jq: int, jk: int) -> Tensor | None:
        """(batch or 1, 1, C, C) bool, or None when every pair is visible (an earlier chunk, full attention, no
        documents)."""
        c = self.c
        if jk < jq and self.starts is None and (self.window is None or (jq + 1) * c - 1 - jk * c < self.window):
            return None
        qpos = torch.arange(jq * c, (jq + 1) * c, device=self.device)[:, None]
        kpos = torch.arange(jk * c, (jk + 1) * c, device=self.device)[None, :]
        keep = kpos <= qpos
        if self.window is not None:
            keep = keep & (kpos > qpos - self.window)
        keep = keep[None, None]
        if self.starts is not None:
            starts = self.starts[:, hq * c : (hq + 1) * c]
            keep = keep & (kpos[None, None] >= starts[:, None, :, None])
        return keep


def _block_forward(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q`` (b, h, C, d) over one key block, ``keep`` its mask: (out, lse); a row that sees
    no key gets out 0, lse -inf."""
    s = (q @ k.transpose(-2, -1)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return p @ v, lse


def _repeat(kv: Tensor, n_rep: int) -> Tensor:
    return kv.repeat_interleave(n_rep, dim=1) if n_rep > 1 else kv


def _fold(grad: Tensor, n_rep: int) -> Tensor:
    """The gradient of repeated kv heads summed back onto each kv head."""
    if n_rep == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, n, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """q (b, h, nC, d), k / v (b, kv_h, nC, d / dv) of this rank's ``n = len(layout(cp, rank))`` chunks (two; a
    hybrid group's ``2 x a2a``) -> (out (b, h, nC, dv), lse (b, h, nC)) over the whole sequence's keys (module
    docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, layout, starts, window):
        cp, rank = mesh.size(), mesh.get_local_rank()
        chunks = layout(cp, rank)
        c, n_rep, scale = q.shape[2] // len(chunks), q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        blocks = _Blocks(chunks, c, starts, window, q.device)
        ring = _Ring(mesh)
        outs = [None] * len(chunks)
        lses = [None] * len(chunks)
        kv = [k, v]
        for i in ring_steps(cp):
            pending = ring.start(kv) if i < cp - 1 else None  # the next pair travels while this one is used
            src_chunks = layout(cp, (rank - i) % cp)
            kr, vr = _repeat(kv[0], n_rep), _repeat(kv[1], n_rep)
            for hq, jq in enumerate(chunks):
                qj = q[:, :, hq * c : (hq + 1) * c]
                for hk, jk in enumerate(src_chunks):
                    if not blocks.visible(jq, jk):
                        continue
                    keys = slice(hk * c, (hk + 1) * c)
                    o_b, l_b = _block_forward(qj, kr[:, :, keys], vr[:, :, keys], blocks.keep(hq, jq, jk), scale)
                    if outs[hq] is None:
                        outs[hq], lses[hq] = o_b, l_b
                    else:
                        outs[hq], lses[hq] = merge(outs[hq], lses[hq], o_b, l_b)
            if pending is not None:
                kv = _Ring.wait(pending)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, starts)
        ctx.mesh, ctx.layout, ctx.window = mesh, layout, window
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, starts = ctx.saved_tensors
        mesh, layout, window = ctx.mesh, ctx.layout, ctx.window
        cp, rank = mesh.size(), mesh.get_local_rank()
        chunks = layout(cp, rank)
        c, n_rep, scale = q.shape[2] // len(chunks), q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        blocks = _Blocks(chunks, c, starts, window, q.device)
        ring = _Ring(mesh)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        d_row = (grad_out * out).sum(-1)
        if grad_lse is not None:
            d_row = d_row - grad_lse
        dq = torch.zeros_like(q)
        kv, dkv = [k, v], [torch.zeros_like(k), torch.zeros_like(v)]
        for i in ring_steps(cp):
            src_chunks = layout(cp, (rank - i) % cp)
            kr, vr = _repeat(kv[0], n_rep), _repeat(kv[1], n_rep)
            dk_rep, dv_rep = torch.zeros_like(kr), torch.zeros_like(vr)
            for hq, jq in enumerate(chunks):
                rows = slice(hq * c, (hq + 1) * c)
                qj, do, lq, dr = q[:, :, rows], grad_out[:, :, rows], lse[:, :, rows], d_row[:, :, rows]
                for hk, jk in enumerate(src_chunks):
                    if not blocks.visible(jq, jk):
                        continue
                    keys = slice(hk * c, (hk + 1) * c)
                    s = (qj @ kr[:, :, keys].transpose(-2, -1)) * scale
                    p = torch.exp(s - lq.unsqueeze(-1))
                    keep = blocks.keep(hq, jq, jk)
                    if keep is not None:
                        p = p.masked_fill(~keep, 0.0)
                    dv_rep[:, :, keys] += p.transpose(-2, -1) @ do
                    ds = p * (do @ vr[:, :, keys].transpose(-2, -1) - dr.unsqueeze(-1)) * scale
                    dq[:, :, rows] += ds @ kr[:, :, keys]
                    dk_rep[:, :, keys] += ds.transpose(-2, -1) @ qj
            dkv = [dkv[0] + _fold(dk_rep, n_rep), dkv[1] + _fold(dv_rep, n_rep)]
            # the gradients travel with the keys / values they belong to; after cp hops they are home
            moving = dkv + (kv if i < cp - 1 else [])
            got = _Ring.wait(ring.start(moving))
            dkv, kv = passed_on(dkv, got[:2]), got[2:]
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh: DeviceMesh,
    layout,
    starts: Tensor | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of this rank's ``q`` (batch, heads, nC, d) over the whole sequence, its keys / values
    ``k, v`` (batch, kv_heads, nC, d) passed around the ring of ``mesh``; ``layout(ring_size, ring_rank)``: the
    ``n`` global chunks a ring rank holds, in local order (``titanlike.parallel.context_parallel.chunk_ids``: two;
    ``hybrid_layout``: the two of every rank of an all-to-all group); ``starts`` (batch, nC): the query rows'
    document starts (None: no documents); ``window``: a sliding window; ``sinks`` (heads,): one sink logit per head,
    merged into the final log-sum-exp. Returns (batch, heads, nC, dv)."""
    out, lse = _RingAttention.apply(q, k, v, mesh, layout, starts, window)
    if sinks is not None:
        out = out * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    return out


class RingAttention(nn.Module):
    """The attention seam by ring attention (module docstring), same interface as
    ``titanlike.models.decoder.AttentionCore``: ``q (batch, s, heads, d)``, ``k, v (batch, s, kv_heads, d)`` of this
    rank's ``s = S / cp`` tokens (``layout(cp, rank)``: the two global chunks a cp rank holds, in local order); the
    seam's ``window`` and ``sinks``. Every cp rank of the mesh must call it."""

    attention_seam = True

    def __init__(self, cp_mesh: DeviceMesh, layout, window: int | None = None, sinks: bool = False):
        super().__init__()
        self.cp_mesh, self.layout = cp_mesh, layout
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return (
            f"cp={self.cp}, chunks={self.layout(self.cp, self.rank)}, ring over key / value blocks, "
            f"window={self.window}"
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask=None, sinks: Tensor | None = None) -> Tensor:
        starts = mask.starts if mask is not None and mask.documents else None
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return ring_attention(qt, kt, vt, self.cp_mesh, self.layout, starts, self.window, sinks).transpose(1, 2)


class RingLatentAttention(nn.Module):
    """Ring attention for the latent seam (multi-head latent attention): the latent is expanded locally by the
    model's up-projection (this rank's tokens: its weight gradients stay in autograd), then the per-head keys and
    values travel around the ring as for any attention."""

    window, sinks = None, False

    def __init__(self, cp_mesh: DeviceMesh, layout):
        super().__init__()
        self.cp_mesh, self.layout = cp_mesh, layout
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, chunks={self.layout(self.cp, self.rank)}, ring over the expanded keys / values"

    def forward(self, q: Tensor, latent: Tensor, k_rope: Tensor, expand, mask=None) -> Tensor:
        k, v = expand(latent, k_rope)
        starts = mask.starts if mask is not None and mask.documents else None
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return ring_attention(qt, kt, vt, self.cp_mesh, self.layout, starts).transpose(1, 2)
