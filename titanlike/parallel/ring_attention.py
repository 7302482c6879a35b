"""Ring attention: context parallelism that passes key / value blocks (MLA: the latent) between the cp ranks.

Each cp rank holds its two load-balanced chunks (``titanlike.parallel.context_parallel``: chunks ``r`` and
``2 cp - 1 - r`` of ``C`` tokens each) of the queries, keys and values. At step ``i`` rank ``r`` attends with the
keys and values of rank ``(r - i) mod cp``: a direct shift by ``i`` (rank ``r`` sends its own to ``r + i`` and
receives those of ``r - i``), the next step's transfer posted before the current block's compute (they overlap
where the backend is asynchronous). The steps are the ones some rank needs (:func:`ring_steps`), fixed by ``cp``,
the chunk length, the window and the layout alone (no host reads): causal full attention needs every step; a
sliding window no wider than a chunk only the neighbours' (steps 0, 1 and ``cp - 1``: chunk ``r`` sees the end of
chunk ``r - 1`` on rank ``r - 1``, chunk ``2 cp - 1 - r`` the end of chunk ``2 cp - 2 - r`` on rank ``r + 1``), so
such a layer moves 2 blocks at any cp instead of ``cp - 1``. Each of the rank's two query chunks attends to each
of the visiting key chunks it can see (a chunk after it is skipped, so is one wholly outside the window) and the
block's result, an output and its rows' log-sum-exps, is merged into the running one (online softmax):
``lse = logaddexp(lse, lse_b)``, ``out = e^(lse_old - lse) out + e^(lse_b - lse) out_b``. No rank ever holds more
than its own, one visiting and one arriving pair of chunks.

Backward (a custom autograd function): the keys and values of each needed step arrive again (the same shifts);
each rank computes the block's share of their gradients (the probabilities recomputed from the final log-sum-exp:
``P = exp(q k^T / sqrt(d) - lse)``, ``dS = P (dO v^T - D)`` with ``D = rowsum(dO o) - dlse``) and sends it straight
home (the reverse shift, to rank ``r - i``), where it is added to the owner's. The queries' gradient stays local.

Multi-head latent attention (:class:`RingLatentAttention`): what travels is the latent and the shared RoPE key
(576 numbers per token for DeepSeek-V3 instead of 2 x 128 x 192 of per-head keys and values); each rank expands
every visiting block with the model's up-projection (``expand``), forward and again in the backward, where the
up-projection's weight gradient of the visiting tokens is accumulated on the computing rank (the data-parallel
reduction over ``dp x cp`` sums every rank's, as it does for the all-gather core) and the latent's and key's
gradients travel home.

Masks: causal (global positions), the document mask (each query row's document start, cut like the inputs) and the
sliding window, all from the global positions of the chunks: no extra collective. Sinks (one logit per head) are
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

__all__ = [
    "RingAttention",
    "RingLatentAttention",
    "merge",
    "passed_on",
    "ring_attention",
    "ring_latent_attention",
    "ring_steps",
    "visiting_weight_grads",
]


def _is_shape_only(t: Tensor) -> bool:
    """Meta tensors (a pipeline stage's shape inference) and fake ones (the planner's probe): no values to send."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor)


class _Shift:
    """Direct shifts over the cp group: :meth:`start` posts the send of ``tensors`` to rank ``r + i`` and the
    receive of as many from ``r - i``; :meth:`wait` returns what arrived. The exchange is
    ``titanlike.parallel.p2p``'s (traced: opaque custom ops, so a compiled block holds the ring whole)."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()

    def _peer(self, d: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + d) % self.cp)

    def start(self, tensors: list[Tensor], i: int):
        if _is_shape_only(tensors[0]):
            return None, [t.clone() for t in tensors]
        return exchange_start(tensors, self.group, self._peer(i), self._peer(-i)), tensors

    @staticmethod
    def wait(pending) -> list[Tensor]:
        exchange, sent = pending
        return sent if exchange is None else exchange_wait(exchange, sent)


def ring_steps(cp: int, layout, c: int, window: int | None) -> tuple[int, ...]:
    """The ring's steps ``i`` (rank ``r`` attending with the keys of rank ``r - i``; 0: its own) that some rank
    needs: one of its chunks (``layout(cp, r)``, ``c`` tokens each) can see one of rank ``r - i``'s (causal, and
    within ``window``). Static: every rank computes the same steps and takes part in every shift."""
    blocks = _Blocks(c, None, window, None)
    return tuple(
        i
        for i in range(cp)
        if i == 0
        or any(blocks.visible(jq, jk) for r in range(cp) for jq in layout(cp, r) for jk in layout(cp, (r - i) % cp))
    )


def passed_on(kept: list[Tensor], arrived: list[Tensor]) -> list[Tensor]:
    """The key / value gradients a rank adds to its own after a backward step: the ones that arrived home
    (``kept``: the visiting block's it computed and sent; the gate's mutation adds those instead)."""
    return arrived


def visiting_weight_grads(grads: tuple) -> tuple:
    """The up-projection's weight gradients of a visiting latent block, accumulated on the computing rank (the
    gate's mutation drops them)."""
    return grads


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

    def __init__(self, c: int, starts: Tensor | None, window: int | None, device):
        self.c, self.starts, self.window, self.device = c, starts, window, device

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

    def pairs(self, chunks, src_chunks):
        """(query half, query chunk, key half, key chunk) of every visible pair."""
        return [
            (hq, jq, hk, jk) for hq, jq in enumerate(chunks) for hk, jk in enumerate(src_chunks) if self.visible(jq, jk)
        ]


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


class _Plan:
    """One call's static plan: this rank's chunks, the chunk length, the steps, the block masks."""

    def __init__(self, q: Tensor, mesh: DeviceMesh, layout, starts: Tensor | None, window: int | None):
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self.layout, self.chunks = layout, layout(self.cp, self.rank)
        self.c, self.scale = q.shape[2] // len(self.chunks), q.shape[-1] ** -0.5
        self.blocks = _Blocks(self.c, starts, window, q.device)
        self.steps = ring_steps(self.cp, layout, self.c, window)
        self.shift = _Shift(mesh)

    def pairs(self, i: int):
        return self.blocks.pairs(self.chunks, self.layout(self.cp, (self.rank - i) % self.cp))

    def arrivals(self, payload: list[Tensor]):
        """(step, the payload of rank ``r - step``) for every step, the next one's transfer posted before the
        current one is handed out (and used)."""
        steps = self.steps
        pending = self.shift.start(payload, steps[1]) if len(steps) > 1 else None
        yield steps[0], payload
        for n, i in enumerate(steps[1:], start=2):
            got = _Shift.wait(pending)
            pending = self.shift.start(payload, steps[n]) if n < len(steps) else None
            yield i, got

    def forward(self, q: Tensor, kr: Tensor, vr: Tensor, i: int, outs: list, lses: list) -> None:
        """Merge the block of the keys / values (repeated to q's heads) of rank ``r - i`` into ``outs`` / ``lses``."""
        c = self.c
        for hq, jq, hk, jk in self.pairs(i):
            keys = slice(hk * c, (hk + 1) * c)
            qj = q[:, :, hq * c : (hq + 1) * c]
            o_b, l_b = _block_forward(qj, kr[:, :, keys], vr[:, :, keys], self.blocks.keep(hq, jq, jk), self.scale)
            if outs[hq] is None:
                outs[hq], lses[hq] = o_b, l_b
            else:
                outs[hq], lses[hq] = merge(outs[hq], lses[hq], o_b, l_b)

    def backward(self, q, grad_out, lse, d_row, kr, vr, i: int, dq: Tensor) -> tuple[Tensor, Tensor]:
        """The block of rank ``r - i``'s keys / values (repeated): adds its share to ``dq``, returns (dk, dv) of
        the repeated heads."""
        c, scale = self.c, self.scale
        dk_rep, dv_rep = torch.zeros_like(kr), torch.zeros_like(vr)
        for hq, jq, hk, jk in self.pairs(i):
            rows, keys = slice(hq * c, (hq + 1) * c), slice(hk * c, (hk + 1) * c)
            qj, do, lq, dr = q[:, :, rows], grad_out[:, :, rows], lse[:, :, rows], d_row[:, :, rows]
            s = (qj @ kr[:, :, keys].transpose(-2, -1)) * scale
            p = torch.exp(s - lq.unsqueeze(-1))
            keep = self.blocks.keep(hq, jq, jk)
            if keep is not None:
                p = p.masked_fill(~keep, 0.0)
            dv_rep[:, :, keys] += p.transpose(-2, -1) @ do
            ds = p * (do @ vr[:, :, keys].transpose(-2, -1) - dr.unsqueeze(-1)) * scale
            dq[:, :, rows] += ds @ kr[:, :, keys]
            dk_rep[:, :, keys] += ds.transpose(-2, -1) @ qj
        return dk_rep, dv_rep

    def home(self, grads_of, payload: list[Tensor]) -> list[Tensor]:
        """The backward's loop: ``grads_of(step, visiting payload)`` -> the payload's gradients; each visiting
        block's sent straight home (the reverse shift) while the next block is computed; returns this rank's own
        payload's gradients, every rank's share summed."""
        own, sending = None, None
        for i, visiting in self.arrivals(payload):
            grads = grads_of(i, visiting)
            if i == 0:
                own = grads
                continue
            if sending is not None:
                own = [a + b for a, b in zip(own, passed_on(sending[1], _Shift.wait(sending[0])), strict=True)]
            sending = (self.shift.start(grads, -i), grads)
        if sending is not None:
            own = [a + b for a, b in zip(own, passed_on(sending[1], _Shift.wait(sending[0])), strict=True)]
        return own

    @staticmethod
    def d_row(grad_out: Tensor, out: Tensor, grad_lse: Tensor | None) -> Tensor:
        d = (grad_out * out).sum(-1)
        return d if grad_lse is None else d - grad_lse


class _RingAttention(torch.autograd.Function):
    """q (b, h, nC, d), k / v (b, kv_h, nC, d / dv) of this rank's ``n = len(layout(cp, rank))`` chunks (two; a
    hybrid group's ``2 x a2a``) -> (out (b, h, nC, dv), lse (b, h, nC)) over the whole sequence's keys (module
    docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, layout, starts, window):
        plan = _Plan(q, mesh, layout, starts, window)
        n_rep = q.shape[1] // k.shape[1]
        outs, lses = [None] * len(plan.chunks), [None] * len(plan.chunks)
        for i, (kv_k, kv_v) in plan.arrivals([k, v]):
            plan.forward(q, _repeat(kv_k, n_rep), _repeat(kv_v, n_rep), i, outs, lses)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, starts)
        ctx.mesh, ctx.layout, ctx.window = mesh, layout, window
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, starts = ctx.saved_tensors
        plan = _Plan(q, ctx.mesh, ctx.layout, starts, ctx.window)
        n_rep = q.shape[1] // k.shape[1]
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        d_row = _Plan.d_row(grad_out, out, grad_lse)
        dq = torch.zeros_like(q)

        def grads_of(i, visiting):
            kr, vr = _repeat(visiting[0], n_rep), _repeat(visiting[1], n_rep)
            dk, dv = plan.backward(q, grad_out, lse, d_row, kr, vr, i, dq)
            return [_fold(dk, n_rep), _fold(dv, n_rep)]

        dk, dv = plan.home(grads_of, [k, v])
        return dq, dk, dv, None, None, None, None


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor:
    if sinks is None:
        return out
    return out * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


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
    ``k, v`` (batch, kv_heads, nC, d) passed between the ranks of ``mesh``; ``layout(ring_size, ring_rank)``: the
    ``n`` global chunks a ring rank holds, in local order (``titanlike.parallel.context_parallel.chunk_ids``: two;
    ``hybrid_layout``: the two of every rank of an all-to-all group); ``starts`` (batch, nC): the query rows'
    document starts (None: no documents); ``window``: a sliding window; ``sinks`` (heads,): one sink logit per head,
    merged into the final log-sum-exp. Returns (batch, heads, nC, dv)."""
    out, lse = _RingAttention.apply(q, k, v, mesh, layout, starts, window)
    return _with_sinks(out, lse, sinks)


# ---------------------------------------------------------------------------------------------- the latent
def _local(t: Tensor):
    """A tensor-parallel ``Replicate`` DTensor (MLA's latent under tp) as its local tensor, its gradient kept a
    ``Partial`` sum over tp (each rank's heads use it), and how to wrap a block of it back; a plain tensor as is."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(t, DTensor):
        return t, None
    partial = (Partial(),) * t.device_mesh.ndim
    return t.to_local(grad_placements=partial), (t.device_mesh, tuple(t.placements), partial)


def _wrap(t: Tensor, spec, grad: bool) -> Tensor:
    if spec is None:
        return t
    from torch.distributed.tensor import DTensor

    from titanlike.parallel.dtensor_grad import from_local

    mesh, placements, partial = spec
    return (
        from_local(t, mesh, placements, partial) if grad else DTensor.from_local(t, mesh, placements, run_check=False)
    )


class _RingLatentAttention(torch.autograd.Function):
    """q (b, h, nC, d) of this rank's chunks, its latent (b, nC, rank) and shared RoPE key (b, nC, 1, rope) ->
    (out (b, h, nC, dv), lse (b, h, nC)); the latent and the key travel, ``expand`` (the model's up-projection,
    ``params`` its parameters) expands every block where it is used, forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, latent, k_rope, mesh, layout, starts, expand, specs, *params):
        plan = _Plan(q, mesh, layout, starts, None)
        outs, lses = [None] * len(plan.chunks), [None] * len(plan.chunks)
        for i, (lat, rope) in plan.arrivals([latent, k_rope]):
            if plan.pairs(i):
                k, v = expand(_wrap(lat, specs[0], False), _wrap(rope, specs[1], False))
                plan.forward(q, k.transpose(1, 2), v.transpose(1, 2), i, outs, lses)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, latent, k_rope, out, lse, starts)
        ctx.mesh, ctx.layout, ctx.expand, ctx.specs, ctx.params = mesh, layout, expand, specs, params
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, latent, k_rope, out, lse, starts = ctx.saved_tensors
        plan = _Plan(q, ctx.mesh, ctx.layout, starts, None)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        d_row = _Plan.d_row(grad_out, out, grad_lse)
        dq = torch.zeros_like(q)
        params = ctx.params
        weights = [None] * len(params)

        def grads_of(i, visiting):
            if not plan.pairs(i):  # nothing of this block seen here: its owner still expects a message
                return [torch.zeros_like(t) for t in visiting]
            lat, rope = (t.detach().requires_grad_() for t in visiting)
            with torch.enable_grad():
                k, v = ctx.expand(_wrap(lat, ctx.specs[0], True), _wrap(rope, ctx.specs[1], True))
                kt, vt = k.transpose(1, 2), v.transpose(1, 2)
            dk, dv = plan.backward(q, grad_out, lse, d_row, kt.detach(), vt.detach(), i, dq)
            got = torch.autograd.grad((kt, vt), (lat, rope, *params), (dk, dv), allow_unused=True)
            mine = got[2:] if i == 0 else visiting_weight_grads(got[2:])
            for n, g in enumerate(mine):
                if g is not None:
                    weights[n] = g if weights[n] is None else weights[n] + g
            return [
                torch.zeros_like(lat) if got[0] is None else got[0],
                torch.zeros_like(rope) if got[1] is None else got[1],
            ]

        d_latent, d_rope = plan.home(grads_of, [latent, k_rope])
        return (dq, d_latent, d_rope, None, None, None, None, None, *weights)


def _expand_params(expand) -> tuple[Tensor, ...]:
    owner = getattr(expand, "__self__", None)
    if not isinstance(owner, nn.Module):
        raise ValueError(
            "ring attention over the latent: expand must be a bound method of the module holding the up-projection "
            f"(e.g. MLA.expand), got {expand!r}; its parameters' gradients are accumulated from every visiting block"
        )
    return tuple(p for p in owner.parameters() if p.requires_grad)


def ring_latent_attention(
    q: Tensor, latent: Tensor, k_rope: Tensor, expand, mesh: DeviceMesh, layout, starts: Tensor | None = None
) -> Tensor:
    """Causal multi-head latent attention of this rank's ``q`` (batch, heads, nC, d) over the whole sequence: the
    ``latent`` (batch, nC, rank) and the shared RoPE key ``k_rope`` (batch, nC, 1, rope) pass between the ranks of
    ``mesh``, each block expanded by ``expand`` (a bound method of the module holding the up-projection, whose
    parameters receive the gradients of every block it expands here). Returns (batch, heads, nC, dv)."""
    latent, lat_spec = _local(latent)
    k_rope, rope_spec = _local(k_rope)
    params = _expand_params(expand)
    out, _ = _RingLatentAttention.apply(q, latent, k_rope, mesh, layout, starts, expand, (lat_spec, rope_spec), *params)
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
    """Ring attention for the latent seam (multi-head latent attention): the latent and the shared RoPE key travel,
    every block is expanded by the model's up-projection where it is used (:func:`ring_latent_attention`)."""

    window, sinks = None, False

    def __init__(self, cp_mesh: DeviceMesh, layout):
        super().__init__()
        self.cp_mesh, self.layout = cp_mesh, layout
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, chunks={self.layout(self.cp, self.rank)}, ring over the latent"

    def forward(self, q: Tensor, latent: Tensor, k_rope: Tensor, expand, mask=None) -> Tensor:
        starts = mask.starts if mask is not None and mask.documents else None
        out = ring_latent_attention(q.transpose(1, 2), latent, k_rope, expand, self.cp_mesh, self.layout, starts)
        return out.transpose(1, 2)
