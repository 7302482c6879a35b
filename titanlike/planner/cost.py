"""What one optimizer step costs a rank: every message by dimension, compute, the pipeline bubble, step time, MFU.

**Messages.** The inventory lists, for one rank and one optimizer step, every collective titanlike's
parallelisms issue, with its size ``M`` (the full tensor: the all-gather's output, the reduce-scatter's input,
the all-reduce's tensor, the p2p payload). A ring moves ``(g-1)/g * M`` per GPU for an all-gather or a
reduce-scatter over ``g`` ranks and ``2(g-1)/g * M`` for an all-reduce; a p2p send moves ``M``. Per microbatch of
``b`` sequences of ``s`` tokens, model dim ``h``, activation bytes ``a``:

* **TP** (every block): 2 all-reduces of ``b s h a`` forward (after ``wo`` and ``w2``) and 2 backward (the inputs
  of ``wq/wk/wv`` and ``w1/w3``): ``8 (t-1)/t b s h a`` per block, Megatron's ``8 L (t-1)/t b s h``. Under SP each
  all-reduce becomes an all-gather + a reduce-scatter (same bytes, twice the messages) and each block adds two
  tiny all-reduces of its norm weights' gradients. Plus the embedding (1 all-reduce, or SP: reduce-scatter
  forward + all-gather backward), the head (its input's all-gather / all-reduce) and the vocab-parallel loss
  (3 all-reduces of one float32 per token and loss chunk). Blocks recomputed by full activation checkpointing
  repeat their forward collectives; selective op-level checkpointing saves them.
* **CP** (every block): an all-gather of K and one of V forward, a reduce-scatter of each one's gradient
  backward, each of ``b S (kv_heads / t) head_dim a`` (the whole sequence's ``S`` tokens, this tp rank's kv
  heads): ``4 (c-1)/c b S kv_dim a / t`` per block. Full AC repeats the two all-gathers in the backward; selective
  op AC saves their outputs. Per-token messages above use the local ``s = S / c`` tokens.
* **PP**: a stage sends its output forward and its input gradient backward once per microbatch it holds:
  ``2 m b s h a`` (``x v`` stages per rank when interleaved), divided by ``t`` under SP (each tp rank sends its
  sequence shard).
* **DP** (FSDP2): per group, an all-gather of the bf16 parameters before its forward (and again before its
  backward when it resharded after the forward) and a reduce-scatter of its float32 gradients:
  ``~ (2 or 3) (d-1)/d P`` per pass; HSDP adds an all-reduce of the gradient shard over ``dp_replicate``. Without
  pp every microbatch pass repeats them (gradient accumulation does not pause the reduce-scatter); under pp the
  schedule gathers once and reduces once per step, after the stage's last backward (phase "step").

A group's messages ride NVLink when every group of that dim sits inside a node, the network otherwise (the
slowest group sets the pace); time = wire bytes / bandwidth + count x latency.

**Step time.** ``compute`` = this rank's FLOPs (the model's training FLOPs of its stage and tokens, plus the
forward of recomputed blocks) / (peak x efficiency). TP collectives sit on the critical path; they and the
compute stretch by the bubble ``(p-1)/(v m)`` (the simulated schedule's idle/busy ratio, exact for every
schedule); PP messages are added in full; FSDP's collectives overlap the compute and only the excess shows,
except the reductions that pp defers to after the last backward, which are exposed in full.
``MFU = model FLOPs of the step / (world x peak x step time)``, the trainer's definition (recomputation is not
model FLOPs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from titanlike.layout import TOKEN_DIMS
from titanlike.layout.timeline import schedule_timeline
from titanlike.models import spec_for as get_spec_for
from titanlike.models.masking import cp_gathered_tokens
from titanlike.planner.hardware import Hardware
from titanlike.planner.layout import Layout
from titanlike.planner.memory import (
    cp_head_widths,
    fsdp_units,
    moe_layers,
    prediction_blocks,
    rank_param_shards,
    unit_group,
    unit_reshards,
)
from titanlike.planner.muon import muon_rank
from titanlike.sharding import HeadNorm, Latent, Norm, entry_for

__all__ = ["Message", "StepCost", "bubble", "messages", "step_cost", "wire_factor"]


@dataclass(frozen=True)
class Message:
    dim: str  # tp | cp | pp | dp_shard (dp_shard_cp under cp) | dp_replicate
    op: str  # all_reduce | all_gather | reduce_scatter | send
    phase: str  # forward | backward | step (between the last backward and the optimizer)
    count: int  # per optimizer step
    nbytes: int  # size M of one message
    group: int  # ranks in the group
    what: str

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank puts on the wire for all ``count`` messages."""
        return self.count * self.nbytes * wire_factor(self.op, self.group)


def wire_factor(op: str, group: int) -> float:
    if op in ("send", "all_to_all"):  # an all-to-all's size is what this rank sends
        return 1.0
    ring = (group - 1) / group
    return 2 * ring if op == "all_reduce" else ring


_PER_BLOCK = ("block", "experts", "moe")  # one FSDP group per block
# FSDP's groups: overlapped with the compute (the experts' over dp_shard_mod_ep, an MoE block's over dp_shard_cp_tp)
_DP_DIMS = ("dp_shard", "dp_shard_cp", "dp_shard_mod_ep", "dp_shard_cp_tp", "dp_replicate")


def _tp_partial_grad(sharding, name: str) -> bool:
    """A tp-replicated parameter whose gradient covers only this rank's heads (a per-head norm, MLA's latent
    down-projections and norms): summed over tp once per pass."""
    return isinstance(entry_for(sharding, name.rpartition(".")[0]), (HeadNorm, Latent))


def _layer_ids(names) -> list[int]:
    return [int(n.split(".")[1]) for n in names if n.startswith("layers.")]


class _Tally:
    """What the message functions of one rank share: the layout's sizes and the running count per message."""

    def __init__(self, layout: Layout, args, rank: int):
        lo = self.lo = layout
        self.args, self.rank = args, rank
        self.out: dict[tuple, int] = defaultdict(int)
        self.b, self.s, self.h = lo.microbatch_size, lo.local_seq_len, args.dim
        self.a, self.t = lo.act_bytes, lo.tp
        self.A = self.b * self.s * self.h * self.a
        # one gathered K (or V), all S tokens
        self.kv_bytes = self.b * lo.seq_len * (args.n_kv_heads // self.t) * args.head_dim * self.a
        self.stage_ids = lo.stage_ids(lo.pp_rank_of(rank))
        self.passes = lo.accum_steps * lo.n_microbatches  # microbatch forwards per stage per step
        self.sharding = get_spec_for(args).sharding_of(args)
        self.shards = rank_param_shards(lo, args, rank)
        self.gb = lo.replicated_grad_bytes  # a tp-replicated weight's gradient
        self.depth_ids = set(get_spec_for(args).prediction_blocks(args).values())  # MTP depths' blocks: no AC

    def ac(self, i: int) -> str:
        """How block ``i`` is checkpointed ("none" for an MTP depth's block: apply_ac wraps the decoder's only)."""
        return "none" if i in self.depth_ids else self.lo.checkpointed(i)

    def full_ac(self, i: int) -> bool:
        """Whether block ``i`` reruns its forward in the backward (full AC)."""
        return self.ac(i) == "full"

    def add(self, dim, op, phase, nbytes, group, what, count):
        if group > 1 and count:
            self.out[(dim, op, phase, int(nbytes), group, what)] += count

    def messages(self) -> list[Message]:
        return [
            Message(dim, op, phase, count, nbytes, group, what)
            for (dim, op, phase, nbytes, group, what), count in self.out.items()
        ]


def messages(layout: Layout, args, rank: int = 0) -> list[Message]:
    """Every message ``rank`` sends in one optimizer step, aggregated by (dim, op, phase, size, what)."""
    tally = _Tally(layout, args, rank)
    for sid in tally.stage_ids:
        names = layout.stages[sid]
        ids = _layer_ids(names)
        depths = prediction_blocks(args, names)  # the MTP depths' blocks, run by the output modules
        moe = moe_layers(args, names)
        if tally.t > 1:
            _tp_messages(tally, sid, names, ids, moe, depths)
        if layout.cp > 1:
            _cp_messages(tally, ids, list(depths.values()))
        if layout.ep > 1:
            _ep_messages(tally, moe)
        _aux_loss_messages(tally, moe)
        if layout.pp > 1:
            _pp_messages(tally, sid)
    _dp_messages(tally)
    _zero1_messages(tally)
    _moe_balancing_messages(tally)
    _muon_messages(tally)
    return tally.messages()


def _tp_messages(tally: _Tally, sid: int, names, ids: list[int], moe, depths: dict[str, int]) -> None:
    """Tensor parallel: the blocks' collectives (the decoder's ``ids`` and the MTP ``depths``' blocks), the
    embedding's, the head's and the loss's (once more per MTP depth: its embedding lookup, the shared head)."""
    lo, add, A, t, passes = tally.lo, tally.add, tally.A, tally.t, tally.passes
    # Blocks under full AC rerun their forward in the backward up to the last op whose saved tensors the
    # backward needs (torch.utils.checkpoint's early stop): every forward collective but w2's. No AC wraps an
    # MTP depth's block.
    recomputed = sum(map(tally.full_ac, ids))
    embeds = ("tok_embeddings" in names) + len(depths)
    heads = ("output" in names) * (1 + len(depths))
    for p in tally.shards[sid]:  # per-head norms, MLA's latents: replicated weights whose gradients sum over tp
        if _tp_partial_grad(tally.sharding, p.name):
            what = "per-head norm / latent weight gradients"
            add("tp", "all_reduce", "backward", p.tp_numel * tally.gb, t, what, passes)
    blocks = [*ids, *depths.values()]
    if lo.sequence_parallel:
        _sp_messages(tally, sid, names, blocks, moe, recomputed, (embeds, heads))
    else:
        add("tp", "all_reduce", "forward", A, t, "block outputs of wo / w2", 2 * len(blocks) * passes)
        add("tp", "all_reduce", "backward", A, t, "block input grads of attention / ffn", 2 * len(blocks) * passes)
        add("tp", "all_reduce", "backward", A, t, "recomputed output of wo (full AC)", recomputed * passes)
        add("tp", "all_reduce", "forward", A, t, "embedding output", embeds * passes)
        add("tp", "all_reduce", "backward", A, t, "head input grad", heads * passes)
    if heads:
        _loss_messages(tally, heads)


def _sp_messages(tally: _Tally, sid: int, names, ids: list[int], moe, recomputed: int, ends: tuple) -> None:
    """Sequence parallel's all-gathers and reduce-scatters in place of tp's all-reduces, and its norms' gradients
    (``ends``: the embedding lookups and head calls of the stage)."""
    add, A, t, passes = tally.add, tally.A, tally.t, tally.passes
    # an MoE block runs on this rank's own tokens (TokenLocal): no all-gather / reduce-scatter around it
    n, local = len(ids), len(moe)
    ffn_recomputed = sum(tally.full_ac(i) for i in ids if i not in moe)
    add("tp", "all_gather", "forward", A, t, "block inputs of attention / ffn", (2 * n - local) * passes)
    add("tp", "reduce_scatter", "forward", A, t, "block outputs of wo / w2", (2 * n - local) * passes)
    add("tp", "all_gather", "backward", A, t, "block outputs of wo / w2", (2 * n - local) * passes)
    add("tp", "reduce_scatter", "backward", A, t, "block inputs of attention / ffn", (2 * n - local) * passes)
    what = "recomputed inputs of attention / ffn (full AC)"
    add("tp", "all_gather", "backward", A, t, what, (recomputed + ffn_recomputed) * passes)
    add("tp", "reduce_scatter", "backward", A, t, "recomputed output of wo (full AC)", recomputed * passes)
    n_norms = 2 * len(ids) + ("norm" in names)
    add("tp", "all_reduce", "backward", tally.h * tally.gb, t, "norm weight gradients (SP)", n_norms * passes)
    # the MTP depths' own residual-stream weights (enorm, hnorm, eh_proj, norm: Norm entries outside their blocks)
    depths = prediction_blocks(tally.args, names)
    blocks, depth_modules = tuple(b + "." for b in depths), tuple(b.rpartition(".")[0] + "." for b in depths)
    for p in tally.shards[sid]:
        if p.name.startswith(depth_modules) and not p.name.startswith(blocks):
            if isinstance(entry_for(tally.sharding, p.name.rpartition(".")[0]), Norm):
                what = "MTP norm / projection weight gradients (SP)"
                add("tp", "all_reduce", "backward", p.tp_numel * tally.gb, t, what, passes)
    embeds, heads = ends
    add("tp", "reduce_scatter", "forward", A, t, "embedding output", embeds * passes)
    add("tp", "all_gather", "backward", A, t, "embedding output grad", embeds * passes)
    add("tp", "all_gather", "forward", A, t, "head input", heads * passes)
    add("tp", "reduce_scatter", "backward", A, t, "head input grad", heads * passes)


def _loss_messages(tally: _Tally, heads: int = 1) -> None:
    """The head's stage under tp: the vocab-parallel loss's all-reduces, or the logits' all-gather (``heads``: the
    loss's calls per microbatch, one per MTP depth more)."""
    lo, add, t = tally.lo, tally.add, tally.t
    passes = tally.passes * heads
    if lo.loss_parallel:
        rows = tally.b * tally.s
        chunk = lo.loss_chunk_size or rows
        full, rest = divmod(rows, chunk)
        what = "vocab-parallel loss (max, sum, target)"
        add("tp", "all_reduce", "forward", chunk * lo.compute_bytes, t, what, 3 * full * passes)
        add("tp", "all_reduce", "forward", rest * lo.compute_bytes, t, what, 3 * (rest > 0) * passes)
    else:
        logits = tally.b * tally.s * tally.args.vocab_size * tally.a
        add("tp", "all_gather", "forward", logits, t, "logits", passes)


def _cp_messages(tally: _Tally, ids: list[int], depths: list[int] = ()) -> None:
    """Context parallel: every softmax block's K and V all-gathers and their gradients' reduce-scatters (a
    sliding-window layer: the window's reach only; MLA: the latent and the shared RoPE key instead,
    ``args.cp_gathered``); a linear-attention block's state maps and conv halos instead
    (:func:`_linear_cp_messages`). ``depths``: the MTP depths' blocks (never checkpointed)."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    if depths:  # the MTP depths read the whole window's token ids and their labels shifted over it (int64)
        window = tally.b * lo.seq_len * 8
        add("cp", "all_gather", "forward", window, lo.cp, "MTP: the window's token ids", passes)
        add("cp", "all_gather", "forward", window, lo.cp, "MTP: the labels of every depth", len(depths) * passes)
    ids = [*ids, *depths]
    linear = {i: get_spec_for(tally.args).linear_attention(tally.args, i) for i in ids}
    _linear_cp_messages(tally, {i: shape for i, shape in linear.items() if shape is not None})
    ids = [i for i in ids if linear[i] is None]
    if lo.cp_method == "alltoall":
        _all_to_all_cp_messages(tally, ids)
        return
    if lo.cp_method == "ring":
        _ring_cp_messages(tally, ids)
        return
    if lo.cp_method == "hybrid":
        _hybrid_cp_messages(tally, ids)
        return
    latent = getattr(tally.args, "cp_gathered", None)  # MLA: the latent and the shared RoPE key, not K and V
    if latent:
        n, recomputed = len(ids), sum(map(tally.full_ac, ids))
        per_head = tally.args.cp_per_head_numbers // tally.t
        for what, width in latent:
            size = tally.b * lo.seq_len * width * tally.a
            note = f"{what} of every block ({width}/token; per-head K and V would be {per_head}/token)"
            add("cp", "all_gather", "forward", size, lo.cp, note, n * passes)
            add("cp", "reduce_scatter", "backward", size, lo.cp, f"{what} grads of every block", n * passes)
            add("cp", "all_gather", "backward", size, lo.cp, f"recomputed {what} (full AC)", recomputed * passes)
        return
    window_of = getattr(tally.args, "window_of", lambda i: None)  # a sliding-window layer: the window's reach only
    for i in ids:
        kv = tally.kv_bytes * cp_gathered_tokens(lo.seq_len, lo.cp, window_of(i)) // lo.seq_len
        add("cp", "all_gather", "forward", kv, lo.cp, "K and V of every block", 2 * passes)
        add("cp", "reduce_scatter", "backward", kv, lo.cp, "K and V grads of every block", 2 * passes)
        recomputed = tally.full_ac(i)
        add("cp", "all_gather", "backward", kv, lo.cp, "recomputed K and V (full AC)", 2 * recomputed * passes)


def ring_hops(lo: Layout, args, i: int) -> int:
    """The transfers of one softmax block ``i`` under the ring (``titanlike.parallel.ring_attention.ring_steps``,
    less its own step): ``cp - 1`` for causal full attention, fewer for a sliding-window layer (a window within a
    chunk: 2); hybrid: over its ``cp / a2a`` groups, each holding ``2 a2a`` chunks."""
    from titanlike.parallel.context_parallel import chunk_ids, hybrid_layout
    from titanlike.parallel.ring_attention import ring_steps

    window = getattr(args, "window_of", lambda i: None)(i)
    if lo.cp_method == "hybrid":
        ring, layout = lo.cp // lo.cp_a2a, hybrid_layout(lo.cp_a2a)
    else:
        ring, layout = lo.cp, chunk_ids
    return len(ring_steps(ring, layout, lo.seq_len // (2 * lo.cp), window)) - 1


def _ring_sends(tally: _Tally, ids: list[int], payload: dict[str, int], ring: int, whose: str) -> None:
    """The ring's sends per block and pass (``payload``: what travels, numbers per token of the rank's tokens;
    ``whose``: "" for the rank's, "group " for hybrid's group's): forward one per step the block needs
    (:func:`ring_hops`), backward the same again and the gradients as many (straight home); recomputation (full or
    selective op AC: the ring function is rerun, its sends are not saved outputs) repeats the forward's."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    local = tally.b * lo.local_seq_len * tally.a
    hops = {i: ring_hops(lo, tally.args, i) for i in ids}
    n = sum(hops.values())
    again = sum(h for i, h in hops.items() if tally.ac(i) != "none")
    for what, width in payload.items():
        size = local * width
        add("cp", "send", "forward", size, ring, f"{what} {whose}blocks to the ranks that need them", n * passes)
        add("cp", "send", "backward", size, ring, f"{what} {whose}blocks again (backward)", n * passes)
        add("cp", "send", "backward", size, ring, f"d{what} {whose}blocks home", n * passes)
        add("cp", "send", "backward", size, ring, f"recomputed {what} {whose}blocks (AC)", again * passes)


def _ring_cp_messages(tally: _Tally, ids: list[int]) -> None:
    """Context parallel by a ring of K/V blocks (``titanlike.parallel.ring_attention``), per softmax block and pass:
    this rank's K and V (its two chunks, kv heads; MLA: the latent and the shared RoPE key, ``args.cp_gathered``)
    sent to the rank of each step the block needs (:func:`_ring_sends`)."""
    if ids:
        _ring_sends(tally, ids, ring_payload(tally.args, tally.t), tally.lo.cp, "")


def ring_payload(args, tp: int) -> dict[str, int]:
    """What the ring method moves per token of a rank (numbers): this tp rank's K and V (kv heads x the head dim);
    MLA the latent and the shared RoPE key (``args.cp_gathered``, replicated over tp)."""
    latent = getattr(args, "cp_gathered", None)
    if latent:
        return dict(latent)
    return {"K": _ring_width(args, tp, "k"), "V": _ring_width(args, tp, "v")}


def _ring_width(args, tp: int, what: str) -> int:
    """Numbers per token of this tp rank's keys (``k``) or values (``v``): kv heads x the head dim."""
    dim = getattr(args, "qk_head_dim", args.head_dim) if what == "k" else getattr(args, "v_head_dim", args.head_dim)
    return args.n_kv_heads // tp * dim


def _all_to_all_cp_messages(tally: _Tally, ids: list[int]) -> None:
    """Context parallel by all-to-all over heads (Ulysses), per softmax block and pass: q, k, v turned from this
    rank's tokens of every head into every token of ``heads / cp`` heads (3 all-to-alls) and the output back (1);
    the backward the reverse four (again the forward's under full AC). A message is the bytes a rank sends away:
    ``(cp - 1) / cp`` of its local tensor. Under block_causal the document starts of the whole sequence (int64) are
    all-gathered once per forward (every block reuses them)."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    if not ids:
        return
    local = tally.b * lo.local_seq_len * tally.a
    n, recomputed = len(ids), sum(map(tally.full_ac, ids))
    for what, width in cp_head_widths(lo, tally.args).items():
        size = local * width * (lo.cp - 1) // lo.cp
        add("cp", "all_to_all", "forward", size, lo.cp, f"{what} heads of every block", n * passes)
        add("cp", "all_to_all", "backward", size, lo.cp, f"{what} head grads of every block", n * passes)
        add("cp", "all_to_all", "backward", size, lo.cp, f"recomputed {what} heads (full AC)", recomputed * passes)
    if lo.documents:
        add("cp", "all_gather", "forward", tally.b * lo.seq_len * 8, lo.cp, "document starts", passes)


def _hybrid_cp_messages(tally: _Tally, ids: list[int]) -> None:
    """Context parallel by ``hybrid`` (``titanlike.parallel.context_parallel.HybridAttention``), per softmax block
    and pass: the all-to-all method's four all-to-alls forward and four backward (again the forward's under full AC)
    inside the group of ``a = context_parallel_a2a_degree`` ranks (each sends ``(a - 1) / a`` of its local q, k, v,
    output); then the ring method's sends over the ``cp / a`` groups, of the group's ``2 a`` chunks of ``heads / a``
    heads: ``b s kv_w'`` numbers each of K and V (``kv_w'``: the kv width repeated to a multiple of ``a``; MLA: every
    head, expanded before the all-to-all), once per step the block needs (:func:`ring_hops`: ``cp / a - 1`` under
    causal full attention) forward, K / V again and dK / dV home as often backward, the forward's again under AC.
    Under block_causal the group's document starts are all-gathered once per forward. All under dim ``cp`` (priced
    on the cp group's link)."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    if not ids:
        return
    a, ring = lo.cp_a2a, lo.cp // lo.cp_a2a
    local = tally.b * lo.local_seq_len * tally.a
    n, recomputed = len(ids), sum(map(tally.full_ac, ids))
    widths = cp_head_widths(lo, tally.args)
    for what, width in widths.items():
        size = local * width * (a - 1) // a
        add("cp", "all_to_all", "forward", size, a, f"{what} heads of every block (group)", n * passes)
        add("cp", "all_to_all", "backward", size, a, f"{what} head grads of every block (group)", n * passes)
        add("cp", "all_to_all", "backward", size, a, f"recomputed {what} heads (full AC, group)", recomputed * passes)
    _ring_sends(tally, ids, {"K": widths["k"], "V": widths["v"]}, ring, "group ")
    if lo.documents:
        add("cp", "all_gather", "forward", tally.b * a * lo.local_seq_len * 8, a, "the group's document starts", passes)


def _linear_cp_messages(tally: _Tally, linear: dict) -> None:
    """The cp messages of the linear-attention blocks (``titanlike.parallel.state_passing``), per block and
    microbatch: the all-gather of every rank's two pieces' state maps ``(B, M)``, ``b x v_heads/tp x dk x (dv + dk)``
    each in at least float32, and of their conv halos (the last ``kernel - 1`` inputs of each piece), both
    reduce-scattered in the backward (again gathered when full AC recomputes the block): independent of seq_len."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    b, t, a = lo.microbatch_size, lo.tp, lo.act_bytes
    for i, (hv, dk, dv, channels, kernel) in linear.items():
        state = lo.cp * 2 * b * (hv // t) * dk * (dv + dk) * lo.compute_bytes
        halo = lo.cp * 2 * b * min(kernel - 1, lo.local_seq_len // 2) * (channels // t) * a
        again = tally.full_ac(i)
        for nbytes, what in ((state, "linear-attention state maps"), (halo, "short-conv halos")):
            add("cp", "all_gather", "forward", nbytes, lo.cp, f"{what} of every linear block", passes)
            add("cp", "reduce_scatter", "backward", nbytes, lo.cp, f"{what} grads of every linear block", passes)
            add("cp", "all_gather", "backward", nbytes, lo.cp, f"recomputed {what} (full AC)", again * passes)


def _ep_messages(tally: _Tally, moe) -> None:
    """Expert parallel: each MoE layer's token counts and its dispatch / combine all-to-alls."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    routed = tally.b * tally.s // (tally.t if lo.ep_tp > 1 else 1)  # its SP shard when ep borrows tp
    off = (lo.ep - 1) / lo.ep
    padded = lo.expert_dispatch == "padded"  # every expert's buffer of the rank's tokens rows, no counts exchange
    for i, m in moe.items():
        rows = round(routed * off * (m.num_experts if padded else m.top_k * lo.expert_imbalance))
        repeat = 1 + tally.full_ac(i)  # full AC reruns the forward's three
        for phase, n, again in (("forward", passes, ""), ("backward", (repeat - 1) * passes, ", full AC")):
            counts = "MoE token counts per expert" + (" (recomputed)" if again else "")
            if not padded:
                add("ep", "all_to_all", phase, m.num_experts * 8 * off, lo.ep, counts, n)
            add("ep", "all_to_all", phase, rows * tally.h * tally.a, lo.ep, _dispatch_what(m, lo, again), 2 * n)
        add("ep", "all_to_all", "backward", rows * tally.h * tally.a, lo.ep, "MoE dispatch / combine grads", 2 * passes)


def _aux_loss_messages(tally: _Tally, moe) -> None:
    """The sequence-wise aux loss sums each sequence's expert counts over the ranks holding pieces of it."""
    lo, passes = tally.lo, tally.passes
    split = lo.cp * lo.ep_tp  # ranks holding pieces of one sequence, each routing its own tokens
    for i, m in moe.items() if split > 1 else ():
        if m.aux_loss_coeff > 0:
            dim = "tp" if lo.cp == 1 else ("cp" if lo.ep_tp == 1 else "cp_tp")
            recomputed = tally.ac(i) != "none"  # a c10d all-reduce: not among the saved ops
            what = "MoE aux loss: expert counts per sequence"
            nbytes = tally.b * m.num_experts * lo.compute_bytes
            tally.add(dim, "all_reduce", "forward", nbytes, split, what, passes)
            tally.add(dim, "all_reduce", "backward", nbytes, split, what, recomputed * passes)


def _pp_messages(tally: _Tally, sid: int) -> None:
    """Pipeline: the stage's output and input gradient per microbatch, and the tied embedding's gradient sum."""
    lo, add, passes = tally.lo, tally.add, tally.passes
    p2p = tally.A // tally.t if lo.sequence_parallel else tally.A
    if sid != len(lo.stages) - 1:
        add("pp", "send", "forward", p2p, 2, "stage output", passes)
    if sid != 0:
        add("pp", "send", "backward", p2p, 2, "stage input grad", passes)
    tied = tally.args.tie_embeddings and (sid == 0 or sid == len(lo.stages) - 1) and not lo.v_placement
    if tied:  # finalize_grads: the two copies of the tied weight sum their gradient shards
        shard = next(p for p in tally.shards[sid] if p.name in ("tok_embeddings.weight", "output.weight"))
        add("pp", "all_reduce", "step", shard.numel * lo.param_bytes, 2, "tied embedding grads", 1)


def _dp_messages(tally: _Tally) -> None:
    """Data parallel (FSDP2): each group's parameter all-gathers and gradient reduce-scatters, HSDP's all-reduce."""
    lo, add, a = tally.lo, tally.add, tally.a
    for sid in tally.stage_ids:
        for kind, params in fsdp_units(lo, tally.args, tally.shards[sid], lo.stages[sid]):
            wrapped = unit_group(lo, params)
            if wrapped is None:
                continue
            fdim, ds = wrapped
            padded = sum(p.padded_numel for p in params)
            reshard = unit_reshards(lo, kind)
            if lo.pp > 1:  # the schedule keeps the stage gathered and reduces once per schedule step
                fwd_ag = lo.accum_steps * (lo.n_microbatches if reshard else 1)
                bwd_ag = lo.accum_steps * lo.n_microbatches if reshard else 0
                rs = lo.accum_steps
            else:
                fwd_ag, bwd_ag, rs = lo.accum_steps, lo.accum_steps if reshard else 0, lo.accum_steps
            what = f"{kind} {'params' if kind not in _PER_BLOCK else 'params (per block)'}"
            # Under pp the schedule runs FSDP's post-backward itself after the stage's last backward:
            # the reduction waits for the whole backward instead of overlapping it.
            reduce_phase = "step" if lo.pp > 1 else "backward"
            add(fdim, "all_gather", "forward", padded * ds * a, ds, what, fwd_ag)
            add(fdim, "all_gather", "backward", padded * ds * a, ds, what, bwd_ag)
            grads, shard_grads = what.replace("params", "grads"), what.replace("params", "grad shards")
            add(fdim, "reduce_scatter", reduce_phase, padded * ds * lo.reduce_bytes, ds, grads, rs)
            add("dp_replicate", "all_reduce", reduce_phase, padded * lo.reduce_bytes, lo.dp_replicate, shard_grads, rs)


def _zero1_messages(tally: _Tally) -> None:
    """ZeRO-1 (parallelism.distributed_optimizer): the gradients' all-reduce over dp_replicate is FSDP's (above);
    the optimizer step updates each rank's rows and all-gathers every parameter once, in the parameters' dtype."""
    lo = tally.lo
    if not lo.distributed_optimizer:
        return
    for sid in tally.stage_ids:
        n = sum(p.numel for p in tally.shards[sid])
        tally.add("dp_replicate", "all_gather", "step", n * lo.param_bytes, lo.dp_replicate, "ZeRO-1 AdamW update", 1)


def _moe_balancing_messages(tally: _Tally) -> None:
    """After the optimizer step (ExpertBalancing.end_step): the aux-loss terms of this rank's MoE layers, the expert
    loads of each of its stages (the bias update; float64 / int64) over the ranks that routed other tokens, and
    under pp every layer's row of the log's table over the stages."""
    lo, args, add = tally.lo, tally.args, tally.add
    held = [moe_layers(args, lo.stages[sid]) for sid in tally.stage_ids]
    every = {i: m for names in lo.stages for i, m in moe_layers(args, names).items()}
    if not every:
        return
    experts, load = next(iter(every.values())).num_experts, lo.dims.expert_load_dim
    if load is not None and any(held):
        size = lo.groups[load].size
        add(load, "all_reduce", "step", 8 * sum(map(len, held)), size, "MoE aux loss per layer (the log)", 1)
        for layers in held:
            add(load, "all_reduce", "step", 8 * len(layers) * experts, size, "MoE expert loads (bias update)", 1)
    add("pp", "all_reduce", "step", 8 * len(every) * (1 + experts), lo.pp, "MoE aux loss and loads (the log)", 1)


def _muon_messages(tally: _Tally) -> None:
    """Muon: the bytes this rank sends over its all-to-alls (gathers to the owners, scatters from them), on average."""
    muon = muon_rank(tally.lo, tally.args, tally.rank)
    if muon is not None and muon.collectives:
        what = f"Muon: matrix blocks to their owners and back ({muon.collectives // 2} buckets)"
        nbytes = muon.sent * tally.lo.ns_bytes / muon.collectives
        tally.add("muon", "all_to_all", "step", nbytes, muon.group, what, muon.collectives)


def _dispatch_what(m, lo: Layout, recomputed: str = "") -> str:
    imbalance = f", busiest rank x{lo.expert_imbalance:g}" if lo.expert_imbalance != 1 else ", balanced"
    again = " recomputed" if recomputed else ""
    if lo.expert_dispatch == "padded":
        off_rank = f"{lo.ep - 1}/{lo.ep} off-rank"
        return f"MoE padded dispatch / combine buffers{again} ({m.num_experts} experts x tokens, {off_rank})"
    return f"MoE dispatch / combine rows{again} (top-{m.top_k}, {lo.ep - 1}/{lo.ep} off-rank{imbalance})"


@lru_cache(maxsize=512)
def bubble(schedule: str, pp: int, m: int, v: int) -> float:
    """Idle over busy time of the schedule (0 without pp): the simulated value, which is ``(p-1)/(v m)`` for
    GPipe / 1F1B / interleaved 1F1B and less for the zero-bubble schedules."""
    if pp == 1:
        return 0.0
    return schedule_timeline(schedule, pp, m, v).bubble_ratio


@dataclass(frozen=True)
class DimCost:
    dim: str
    messages: int
    wire_bytes: float
    link: str
    seconds: float
    exposed: float  # seconds on the critical path


@dataclass(frozen=True)
class StepCost:
    compute: float  # seconds of this rank's kernels per step
    model_flops: float  # FLOPs of the step (the whole job), MFU's numerator
    rank_flops: float  # FLOPs this rank executes (its share, plus recomputation)
    bubble: float
    dims: dict[str, DimCost]
    step_time: float
    mfu: float
    tokens_per_s: float
    world_size: int
    optimizer_flops: float = 0.0  # Muon's Newton-Schulz FLOPs on this rank
    optimizer: float = 0.0  # seconds of Muon's step on this rank (Newton-Schulz + its all-to-alls): exposed

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size


def _stage_flops_per_token(layout: Layout, args, names) -> tuple[float, float]:
    """(training FLOPs per token of the stage's blocks and head, forward FLOPs of its recomputed blocks): the model's
    own ``flops_per_token`` (6 per matmul parameter, the head's ``6 V h`` included; attention's ``12 s`` per unit of
    attention width), split into its ``n_layers`` equal blocks and the head. Under the block-causal mask a block's
    attention term (the part linear in the sequence length) is scaled by ``layout.attention_fraction``, the share of
    the causal attention the corpus's documents keep."""
    head = 6 * args.vocab_size * args.dim
    attention = (args.flops_per_token(layout.seq_len) - args.flops_per_token(0)) / args.n_layers
    per_block = (args.flops_per_token(layout.seq_len) - head) / args.n_layers - attention * (
        1 - layout.attention_fraction
    )
    ids = _layer_ids(names)
    train = per_block * len(ids) + (head if "output" in names else 0)
    recompute = sum(per_block / 3 for i in ids if layout.checkpointed(i) == "full")
    return train, recompute


def _rank_flops(lo: Layout, args) -> float:
    """The FLOPs of the busiest pipeline rank in one step (the embedding / head make the first and last differ)."""
    tokens = lo.tokens_per_step
    per_rank = []
    for pp_rank in range(lo.pp):
        train = recompute = 0.0
        for sid in lo.stage_ids(pp_rank):
            tr, rc = _stage_flops_per_token(lo, args, lo.stages[sid])
            train, recompute = train + tr, recompute + rc
            padded = lo.expert_dispatch == "padded"  # every rank computes experts x tokens rows, whatever the load
            if lo.ep > 1 or padded:  # else the busiest expert-parallel rank: imbalance x the mean of the routed rows
                for i, m in moe_layers(args, lo.stages[sid]).items():
                    extra = m.num_experts - m.top_k if padded else m.top_k * (lo.expert_imbalance - 1)
                    routed = 6 * 3 * m.dim * m.hidden_dim * extra
                    train += routed
                    recompute += routed / 3 if lo.checkpointed(i) == "full" else 0
        per_rank.append((train + recompute) * tokens / (lo.dp * lo.cp * lo.tp))
    return max(per_rank)


def _dim_costs(lo: Layout, args, hw: Hardware, rank: int) -> tuple[dict, dict[str, float]]:
    """Each dim's messages priced on its link; and the seconds of each dim's messages that wait for the end of the
    backward (phase "step")."""
    by_dim: dict[str, list[Message]] = defaultdict(list)
    for msg in messages(lo, args, rank):
        by_dim[msg.dim].append(msg)
    dims, after = {}, {}  # after: seconds of the dim's messages that wait for the end of the backward
    for dim, msgs in by_dim.items():
        gm = lo.groups[dim]
        bw = hw.link_bw(gm.crosses_nodes)

        def seconds(ms):
            return sum(m.wire_bytes for m in ms) / bw + sum(m.count for m in ms) * hw.latency_s

        dims[dim] = DimCost(
            dim, sum(m.count for m in msgs), sum(m.wire_bytes for m in msgs), gm.link, seconds(msgs), 0.0
        )
        after[dim] = seconds([m for m in msgs if m.phase == "step"])
    return dims, after


def step_cost(layout: Layout, args, hw: Hardware, rank: int = 0) -> StepCost:
    lo = layout
    tokens = lo.tokens_per_step
    model_flops = args.flops_per_token(lo.seq_len) * tokens
    rank_flops = _rank_flops(lo, args)
    compute = rank_flops / (hw.peak_flops * hw.compute_efficiency)

    dims, after = _dim_costs(lo, args, hw, rank)
    bub = bubble(lo.schedule or "1F1B", lo.pp, lo.n_microbatches, lo.stages_per_rank)
    tp_s = dims["tp"].seconds if "tp" in dims else 0.0
    # synchronous inside attention (and the MoE aux loss's counts over cp x tp): on the critical path
    cp_s = sum(dims[d].seconds for d in ("cp", "cp_tp") if d in dims)
    if lo.cp_method in ("ring", "hybrid") and "cp" in dims:  # the next block's transfer runs under this block's
        ring_s = _send_seconds(lo, args, hw, rank)  # attention (hybrid: its sends; its all-to-alls are exposed)
        cp_s -= ring_s - max(0.0, ring_s - _ring_attention_seconds(lo, args, hw))
    ep_s = dims["ep"].seconds if "ep" in dims else 0.0  # the MoE blocks wait for their tokens: on the critical path
    pp_s = dims["pp"].seconds if "pp" in dims else 0.0
    dp = [d for d in _DP_DIMS if d in dims]
    dp_after = sum(after[d] for d in dp)  # reductions after the last backward: nothing left to hide them under
    dp_overlap = sum(dims[d].seconds for d in dp) - dp_after
    dp_exposed = dp_after + max(0.0, dp_overlap - compute)
    # Muon's step runs after the backward and before the next forward: nothing hides it (the slowest rank's)
    muon = [muon_rank(lo, args, r) for r in {rank, *(p * lo.world_size // lo.pp for p in range(lo.pp))}]
    ns = max((m.ns_flops for m in muon if m is not None), default=0)
    muon_s = dims["muon"].seconds if "muon" in dims else 0.0
    optimizer = ns / (hw.peak_flops * hw.compute_efficiency) + muon_s
    # the MoE balancing's all-reduces after the optimizer step: nothing hides them
    balance = [d for d in TOKEN_DIMS if d in dims]
    step = (compute + tp_s + cp_s + ep_s) * (1 + bub) + pp_s + dp_exposed + optimizer
    step += sum(dims[d].seconds for d in balance)
    for d, exposed in (
        ("tp", tp_s * (1 + bub)),
        ("cp", (cp_s - (dims["cp_tp"].seconds if "cp_tp" in dims else 0.0)) * (1 + bub) if "cp" in dims else 0.0),
        ("cp_tp", dims["cp_tp"].seconds * (1 + bub) if "cp_tp" in dims else 0.0),
        ("ep", ep_s * (1 + bub)),
        ("pp", pp_s),
        ("muon", muon_s),
        *((d, dims[d].seconds) for d in balance),
    ):
        if d in dims:
            dims[d] = _replace(dims[d], exposed)
    for d in dp:  # split the exposed time in proportion
        total = sum(dims[x].seconds for x in dp)
        dims[d] = _replace(dims[d], dp_exposed * dims[d].seconds / total if total else 0.0)
    mfu = model_flops / (lo.world_size * hw.peak_flops * step)
    return StepCost(
        compute=compute,
        model_flops=model_flops,
        rank_flops=rank_flops,
        bubble=bub,
        dims=dims,
        step_time=step,
        mfu=mfu,
        tokens_per_s=tokens / step,
        world_size=lo.world_size,
        optimizer_flops=ns,
        optimizer=optimizer,
    )


def _send_seconds(lo: Layout, args, hw: Hardware, rank: int) -> float:
    """Seconds of the cp ring's point-to-point sends in one step (the ring method's every cp message, hybrid's
    sends across the groups), on the cp group's link."""
    sends = [m for m in messages(lo, args, rank) if m.dim == "cp" and m.op == "send"]
    bw = hw.link_bw(lo.groups["cp"].crosses_nodes)
    return sum(m.wire_bytes for m in sends) / bw + sum(m.count for m in sends) * hw.latency_s


def _ring_attention_seconds(lo: Layout, args, hw: Hardware) -> float:
    """The attention compute of the busiest pipeline rank's softmax blocks in one step (forward, backward and any
    recomputation: 3 x the forward's ``4 q_w S / 2`` FLOPs per token under the causal mask, x the mask's attention
    fraction), which a ring's transfers overlap (``titanlike.parallel.ring_attention`` posts the next block's send
    before computing with the current one)."""
    spec = get_spec_for(args)
    q_w = args.n_heads * getattr(args, "qk_head_dim", args.head_dim) // lo.tp
    per_token = 3 * 4 * q_w * lo.seq_len / 2 * lo.attention_fraction
    tokens = lo.tokens_per_step // (lo.dp * lo.cp)
    blocks = max(
        sum(1 for sid in lo.stage_ids(p) for i in _layer_ids(lo.stages[sid]) if spec.linear_attention(args, i) is None)
        for p in range(lo.pp)
    )
    return per_token * tokens * blocks / (hw.peak_flops * hw.compute_efficiency)


def _replace(d: DimCost, exposed: float) -> DimCost:
    return DimCost(d.dim, d.messages, d.wire_bytes, d.link, d.seconds, exposed)
