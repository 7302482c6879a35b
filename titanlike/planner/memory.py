"""Memory per rank: parameter shards, gradients, AdamW states, FSDP buffers and activations.

Shapes are exact. Each parameter's local shape follows the layouts titanlike applies, read off the model's sharding
entries (``titanlike.sharding.param_dims``, the same entries the tensor-parallel plan is translated from): Llama's
``wq wk wv w1 w3 output tok_embeddings`` on dim 0 and ``wo w2`` on dim 1 (norm weights replicated), then FSDP2
shards the tp-local tensor over ``dp_shard`` (dim 0; dim 1 for a chunk-sharded fused projection). Both split like
``torch.chunk``: ``ceil(n / k)`` per rank, the last ranks smaller or empty. FSDP's collectives move the padded size
(every rank ``ceil(n / k)`` rows). AdamW holds ``exp_avg`` and ``exp_avg_sq`` per parameter shard plus a float32
``step`` scalar; Muon one ``momentum_buffer`` per matrix shard (its step's transient working set:
``titanlike.planner.muon``).

Activations are what autograd keeps between a block's forward and its backward, per token, with ``h`` the model
dim, ``H`` the SwiGLU width, ``n`` the heads, ``a`` the activation bytes (2 in bf16), ``c`` the norms' compute
bytes (4), ``t`` the tp degree and ``t_sp`` = t under sequence parallelism else 1. Derived from the model's code
and checked against the saved tensors of real runs (tests/planner/test_planner.py):

* each RMSNorm: its float32 input copy and rstd, its bf16 normalised input ``(c h + c + a h) / t_sp``, and its
  output as saved by the next matmuls, ``a h`` (all-gathered to full length under SP);
* attention: q, the repeated k and v, the output (``4 a h / t``) and the log-sum-exp (``4 n / t``);
* SwiGLU: w1 and w3 outputs, SiLU output, their product (``4 a H / t``).

Activation checkpointing keeps, per block, ``full``: the block input ``a h / t_sp``; selective ``op``: the input
plus every matmul / attention / collective output (titanlike.parallel.activation_checkpoint.SAC_SAVE_OPS);
and recomputes one block at a time in the backward (a transient block's worth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from titanlike.layout.timeline import schedule_timeline
from titanlike.planner.layout import Layout
from titanlike.sharding import HeadNorm, entry_for, param_dims

__all__ = [
    "STATE_ITEMS",
    "MemoryItem",
    "ParamShard",
    "block_activation_bytes",
    "chunk",
    "fsdp_units",
    "inflight_microbatches",
    "param_shapes",
    "rank_activation_memory",
    "rank_memory",
    "rank_param_shards",
    "rank_state_memory",
]


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` / ``Shard`` splits ``n`` into ``parts``."""
    c = -(-n // parts)
    return max(0, min(c, n - c * index))


def _spec(args):
    from titanlike.models import spec_for

    return spec_for(args)


_MODELS: dict[tuple, object] = {}  # (model name, repr(args)) -> the whole model on the meta device
_STAGES: dict[tuple, tuple[dict[str, tuple[int, ...]], list[list[str]]]] = {}


def _meta_model(spec, args):
    key = (spec.name, repr(args))
    if key not in _MODELS:
        if len(_MODELS) > 8:
            _MODELS.clear()
        _MODELS[key] = spec.build_meta(args)
    return _MODELS[key]


def _stage(args, names: tuple[str, ...]) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """(parameter shapes, tied name groups) of the stage holding ``names``: the model's own constructor on the meta
    device, cut by the pipeline's stage builder, ties found by identity."""
    from titanlike.parallel.pipeline import build_stage
    from titanlike.parallel.ties import tie_groups

    spec = _spec(args)
    key = (spec.name, repr(args), names)
    if key not in _STAGES:
        stage = build_stage(_meta_model(spec, args), names)
        _STAGES[key] = ({k: tuple(p.shape) for k, p in stage.named_parameters()}, tie_groups(stage))
    return _STAGES[key]


def param_shapes(args, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Full shapes of the parameters of a stage holding modules ``names`` (the model's own FQNs, in
    ``named_parameters`` order; a tied head inside the stage is the embedding's parameter)."""
    return dict(_stage(args, tuple(names))[0])


@dataclass(frozen=True)
class ParamShard:
    name: str
    shape: tuple[int, ...]  # full
    tp_shape: tuple[int, ...]  # after tensor parallelism: what FSDP all-gathers
    local_shape: tuple[int, ...]  # what this rank stores
    padded_numel: int  # FSDP's per-rank all-gather share (dim 0 padded to ceil(n / dp_shard))

    @property
    def numel(self) -> int:
        return _prod(self.local_shape)

    @property
    def tp_numel(self) -> int:
        return _prod(self.tp_shape)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def rank_param_shards(layout: Layout, args, rank: int = 0) -> dict[int, list[ParamShard]]:
    """Per stage held by ``rank``: its parameters' full, tp-local and stored shapes."""
    c = layout.coords(rank)
    ds, shard_index = layout.fsdp_shard, layout.fsdp_shard_index(c)
    out = {}
    for s in layout.stage_ids(c["pp"]):
        shards = []
        sharding = _spec(args).sharding_of(args)
        for name, shape in param_shapes(args, layout.stages[s]).items():
            tp_shape = list(shape)
            d, fd = param_dims(sharding, name, len(shape), tp=layout.tp, fsdp=layout.fsdp)
            if d is not None:
                tp_shape[d] = chunk(shape[d], layout.tp, c["tp"])
            local, padded = list(tp_shape), _prod(tp_shape)
            if layout.fsdp:
                local[fd] = chunk(tp_shape[fd], ds, shard_index)
                padded = -(-tp_shape[fd] // ds) * _prod(tp_shape) // max(1, tp_shape[fd])
            shards.append(ParamShard(name, tuple(shape), tuple(tp_shape), tuple(local), padded))
        out[s] = shards
    return out


def fsdp_units(
    layout: Layout, args, shards: list[ParamShard], names: Sequence[str]
) -> list[tuple[str, list[ParamShard]]]:
    """FSDP groups of one stage module as titanlike.parallel.fsdp.apply_fsdp builds them: (kind, params) with kind
    "block", "embedding", "head" or "root"; groups without parameters are left out."""
    by_name = {p.name: p for p in shards}
    spec = _spec(args)
    inputs = [n for n in spec.input_modules if n in names]
    outputs = [n for n in spec.output_modules if n in names]
    # apply_fsdp leaves a parameter the input and output modules share (a tied embedding / head) to the root
    owners = [{name.split(".")[0] for name in group} for group in _stage(args, tuple(names))[1]]
    tied_owners = set().union(*(o for o in owners if o & set(inputs) and o & set(outputs)))
    tied = bool(tied_owners)
    units: list[tuple[str, list[ParamShard]]] = []
    taken: set[str] = set()

    def add(kind, prefixes):
        params = [p for p in shards if p.name.startswith(prefixes) and p.name not in taken]
        taken.update(p.name for p in params)
        if params:
            units.append((kind, params))

    for name in names:
        if name.startswith("layers."):
            add("block", (name + ".",))
    if tied:  # apply_fsdp leaves the tied pair (and the head) to the root
        inputs, outputs = [n for n in inputs if n not in tied_owners], []
    if inputs:
        add("embedding", tuple(n + "." for n in inputs))
    if outputs:
        add("head", tuple(n + "." for n in outputs))
    rest = [p for p in by_name.values() if p.name not in taken]
    if rest:
        units.append(("root", rest))
    return units


# ------------------------------------------------------------------------------------------------- activations
def block_activation_bytes(layout: Layout, args, tokens: int, mode: str = "none") -> int:
    """Bytes one transformer block keeps for its backward, for ``tokens`` tokens of one microbatch.

    The block's structure comes from its model spec (``norm_kind``, ``mlp_kind``; per-head q/k norms where its
    sharding has ``HeadNorm`` entries) and its args (attention widths ``n_heads x head_dim`` and
    ``n_kv_heads x head_dim``, which need not be the model dim): Llama (RMSNorm upcast to float32, SwiGLU), GPT-2
    (LayerNorm, fused q|k|v, GELU MLP), Qwen3-like blocks (QK-norm); each equals the planner's dry-run probe
    (FakeTensorMode)."""
    h, H, n, kv_n = args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads
    q_w, kv_w = n * args.head_dim, kv_n * args.head_dim  # attention widths (= h for Llama and GPT-2)
    a, c, t = layout.act_bytes, layout.compute_bytes, layout.tp
    tsp = t if layout.sequence_parallel else 1
    spec = _spec(args)
    gelu = spec.mlp_kind == "gelu"
    layer_norm = spec.norm_kind == "layer"
    qk_norm = any(isinstance(e, HeadNorm) for e in spec.sharding_of(args).values())
    # Context parallel (``tokens`` are the local ones): the attention kernel keeps K and V of the whole sequence,
    # repeated to all heads as its inputs (no AC: (cp - 1) more tokens' worth than the local K / V counted below);
    # selective op AC saves the all-gather outputs instead (kv heads) and recomputes the rest.
    gathered_kv = 0.0
    if layout.cp > 1 and mode == "none":
        gathered_kv = 2 * a * q_w / t * (layout.cp - 1)
    elif layout.cp > 1 and mode == "op":
        gathered_kv = 2 * a * kv_w / t * layout.cp
    if mode == "full":
        per_token = a * h / tsp
    elif mode == "op":
        # the projections' outputs: q, k, v (GPT-2's fused c_attn alike), wo's local partial, the MLP's (SwiGLU: w1,
        # w3, w2's partial; GELU: c_fc, c_proj's partial)
        mm = a * (q_w + 2 * kv_w) / t + a * h + (1 if gelu else 2) * a * H / t + a * h
        sdpa = a * q_w / t + 4 * n / t
        if t > 1 and layout.sequence_parallel:
            coll = 2 * a * h + 2 * a * h / t  # all-gathers before attention / ffn, reduce-scatters after
        elif t > 1:
            coll = 2 * a * h  # all-reduces after wo / w2
        else:
            coll = 0
        per_token = a * h / tsp + mm + sdpa + coll
    else:
        # a norm keeps its input and statistics (RMSNorm: the float32 upcast and rstd; LayerNorm: the input and
        # 4 bytes of statistics), its output (the projection's input, all-gathered under SP); q, k, v, the
        # attention output and its log-sum-exp; the MLP's hidden activations (SwiGLU: 4, GELU: 2); per-head q / k
        # RMSNorms: their float32 input, one rstd per head and their output (for the weight's gradient)
        norm = (a * h + 4) if layer_norm else (c * h + c + a * h)
        norms = 2 * (norm / tsp + a * h)
        attention = 2 * a * q_w + 2 * a * q_w + 4 * n  # q, repeated k and v, output; log-sum-exp
        if qk_norm:
            attention += (c + a) * (q_w + kv_w) + c * (n + kv_n)
        per_token = norms + (attention + (2 if gelu else 4) * a * H) / t
    return round((per_token + gathered_kv) * tokens)


def head_activation_bytes(layout: Layout, args, tokens: int) -> tuple[int, int]:
    """(kept until the backward, transient peak) of the final norm, the logits and the loss for ``tokens``."""
    h, V = args.dim, args.vocab_size
    a, c, t = layout.act_bytes, layout.compute_bytes, layout.tp
    tsp = t if layout.sequence_parallel else 1
    v_local = V / t if layout.loss_parallel else V  # without loss parallel the logits are all-gathered
    kept = (c * h + c + a * h) / tsp + a * h + a * v_local  # final norm, head input, logits saved by the loss
    rows = min(tokens, layout.loss_chunk_size) if layout.loss_chunk_size else tokens
    transient = 3 * c * v_local * rows + a * v_local * tokens  # float32 working set + the logits' gradient
    return round(kept * tokens), round(transient)


@lru_cache(maxsize=512)
def inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Peak number of (stage, microbatch) activations alive at once on each pp rank, per stage it holds.

    Simulated with titanlike.layout.timeline (the orders torch's schedules run); an activation lives from
    the end of its forward to the end of its last backward action (B, or W for zero-bubble schedules). Returned
    per rank as a tuple over that rank's stages (in stage order) of the counts at the rank's peak moment.
    """
    tl = schedule_timeline(schedule, pp, m, v)
    out = []
    for blocks in tl.ranks:
        stages = sorted({b.stage for b in blocks})
        last_bwd = {}
        for b in blocks:
            if b.kind != "F":
                key = (b.stage, b.microbatch)
                last_bwd[key] = max(last_bwd.get(key, 0.0), b.end)
        events = []
        for b in blocks:
            if b.kind == "F":
                events.append((b.end, 1, b.stage))
                events.append((last_bwd[(b.stage, b.microbatch)], -1, b.stage))
        alive = dict.fromkeys(stages, 0)
        best, best_total = dict(alive), 0
        for _, delta, stage in sorted(events, key=lambda e: (e[0], e[1])):
            alive[stage] += delta
            total = sum(alive.values())
            if total > best_total:
                best_total, best = total, dict(alive)
        out.append(tuple(best[s] for s in stages))
    return tuple(out)


# ------------------------------------------------------------------------------------------------- the total
@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: float
    note: str = ""


STATE_ITEMS = ("parameters", "gradients", "optimizer", "gathered params", "unsharded grads", "autocast weights")


def rank_memory(layout: Layout, args, rank: int = 0) -> list[MemoryItem]:
    """Memory of ``rank`` at its peak (the start of its first backward), item by item: :func:`rank_state_memory`,
    then the activations and the transient working set."""
    return rank_state_memory(layout, args, rank) + rank_activation_memory(layout, args, rank)


def rank_state_memory(layout: Layout, args, rank: int = 0) -> list[MemoryItem]:
    """What ``rank`` holds whatever the batch (the items named in :data:`STATE_ITEMS`): its parameter shards, their
    gradients and AdamW states, and FSDP's gathered parameters / unsharded gradients of the groups in flight (or
    autocast's bf16 weight copies)."""
    shards = rank_param_shards(layout, args, rank)
    pb, a = layout.param_bytes, layout.act_bytes
    n_local = sum(p.numel for ps in shards.values() for p in ps)
    n_tensors = sum(len(ps) for ps in shards.values())
    sharded = (
        f"sharded over {layout.fsdp_dim} {layout.fsdp_shard}" if layout.fsdp and layout.fsdp_shard > 1 else "unsharded"
    )
    items = [
        MemoryItem("parameters", n_local * pb, f"{n_local / 1e6:,.1f}M elements, fp{8 * pb} master copy, {sharded}"),
        MemoryItem("gradients", n_local * pb, f"fp{8 * pb}, same shards"),
        _optimizer_item(layout, args, shards, n_local, n_tensors),
    ]
    # Gathered parameters / unsharded gradients.
    stage_units = {s: fsdp_units(layout, args, ps, layout.stages[s]) for s, ps in shards.items()}
    if layout.fsdp:
        resident = [u for units in stage_units.values() for u in units if not layout.reshard(u[0])]
        blocks = [u for units in stage_units.values() for u in units if layout.reshard(u[0])]
        gathered = sum(p.tp_numel for _, ps in resident for p in ps)
        largest = sorted((sum(p.tp_numel for p in ps) for _, ps in blocks), reverse=True)[:2]
        gathered += sum(largest)
        note = (
            "every group gathered for the whole step (no reshard after forward)"
            if not blocks
            else f"two groups in flight (current + prefetched){' + head/root kept' if resident else ''}"
        )
        items.append(MemoryItem("gathered params", gathered * a, f"{note}, {_dtype(a)}"))
        if layout.pp > 1:  # gradient sync is off until the last microbatch: unsharded grads accumulate
            grads = sum(p.tp_numel for units in stage_units.values() for _, ps in units for p in ps)
            items.append(
                MemoryItem(
                    "unsharded grads",
                    grads * layout.reduce_bytes,
                    "accumulated across microbatches until the last backward (pp)",
                )
            )
        else:
            unit = max((sum(p.tp_numel for p in ps) for units in stage_units.values() for _, ps in units), default=0)
            items.append(
                MemoryItem("unsharded grads", unit * (a + layout.reduce_bytes), "one group before its reduce-scatter")
            )
    elif layout.precision == "autocast":
        items.append(MemoryItem("autocast weights", n_local * 2, "bf16 copies of every weight during fwd+bwd"))
    return items


def _optimizer_item(layout: Layout, args, shards, n_local: int, n_tensors: int) -> MemoryItem:
    """AdamW's two moments (+ a float32 step) per parameter; under Muon one momentum buffer per matrix parameter
    (the sharding entries' matrices) and AdamW's state for the rest."""
    pb = layout.param_bytes
    if layout.optimizer != "Muon":
        return MemoryItem("optimizer", 2 * n_local * pb + 4 * n_tensors, "AdamW exp_avg + exp_avg_sq (+ step scalars)")
    sharding = _spec(args).sharding_of(args)
    muon = [p for ps in shards.values() for p in ps if _is_matrix(sharding, p)]
    n_muon = sum(p.numel for p in muon)
    return MemoryItem(
        "optimizer",
        n_muon * pb + 2 * (n_local - n_muon) * pb + 4 * (n_tensors - len(muon)),
        f"Muon momentum_buffer ({len(muon)} matrix parameters) + AdamW exp_avg + exp_avg_sq (+ step scalars)",
    )


def _is_matrix(sharding, p: ParamShard) -> bool:
    owner, _, leaf = p.name.rpartition(".")
    entry = entry_for(sharding, owner)
    return entry is not None and entry.matrices(leaf, p.shape) is not None


def rank_activation_memory(layout: Layout, args, rank: int = 0) -> list[MemoryItem]:
    """The activations ``rank`` keeps at its peak and its largest transient working set."""
    items: list[MemoryItem] = []
    c = layout.coords(rank)
    stage_ids = layout.stage_ids(c["pp"])
    tokens = layout.microbatch_size * layout.local_seq_len
    if layout.pp > 1:
        counts = inflight_microbatches(
            layout.schedule or "1F1B", layout.pp, layout.n_microbatches, layout.stages_per_rank
        )[c["pp"]]
    else:
        counts = (1,)
    act = transient = 0.0
    detail = []
    for s, count in zip(stage_ids, counts):
        ids = [int(n.split(".")[1]) for n in layout.stages[s] if n.startswith("layers.")]
        per_mb = sum(block_activation_bytes(layout, args, tokens, layout.checkpointed(i)) for i in ids)
        if "output" in layout.stages[s]:
            kept, tr = head_activation_bytes(layout, args, tokens)
            per_mb += kept
            transient = max(transient, tr)
        act += count * per_mb
        detail.append(f"{count} x stage {s}" if layout.pp > 1 else "1 microbatch")
        if any(layout.checkpointed(i) != "none" for i in ids):
            recompute = max(
                block_activation_bytes(layout, args, tokens)
                - block_activation_bytes(layout, args, tokens, layout.checkpointed(i))
                for i in ids
            )
            transient = max(transient, recompute)
    ac = layout.ac_mode if layout.ac_mode != "selective" else f"selective {layout.ac_option}"
    sp = "on" if layout.sequence_parallel else "off"
    cp = f" (seq {layout.seq_len} / cp {layout.cp})" if layout.cp > 1 else ""
    items.append(
        MemoryItem(
            "activations",
            act,
            f"{' + '.join(detail)} of {layout.microbatch_size} x {layout.local_seq_len} tokens{cp}, AC {ac}, SP {sp}",
        )
    )
    items.append(MemoryItem("transient", transient, "largest of: loss working set, one block's recomputation"))
    return items


def _dtype(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32", 8: "fp64"}[nbytes]
