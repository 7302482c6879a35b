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
* attention: q, k and v (kv heads: grouped-query attention reads them in place; repeated to every head by the
  all-gather and ring context-parallel cores, to a multiple of cp by the all-to-all), the output and the
  log-sum-exp (``4 n / t``);
* SwiGLU: w1 and w3 outputs, SiLU output, their product (``4 a H / t``).

Activation checkpointing keeps, per block, ``full``: the block input ``a h / t_sp``; selective ``op``: the input
plus every matmul / attention / collective output (titanlike.parallel.activation_checkpoint.SAC_SAVE_OPS);
and recomputes one block at a time in the backward (a transient block's worth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from titanlike.layout.timeline import schedule_timeline
from titanlike.models.spec import ActivationSizes
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
    "moe_activation_bytes",
    "moe_layers",
    "param_shapes",
    "prediction_activation_bytes",
    "prediction_blocks",
    "rank_activation_memory",
    "rank_memory",
    "rank_param_shards",
    "rank_state_memory",
    "rank_host_memory",
    "offloaded_activation_bytes",
    "unit_group",
]


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` / ``Shard`` splits ``n`` into ``parts``."""
    c = -(-n // parts)
    return max(0, min(c, n - c * index))


def _spec(args):
    from titanlike.models import spec_for

    return spec_for(args)


_MODELS: dict[tuple, object] = {}  # (model name, repr(args)) -> the whole model on the meta device
_STAGES: dict[tuple, StageFacts] = {}


@dataclass(frozen=True)
class StageFacts:
    """What the planner reads off one stage module built on the meta device."""

    shapes: dict[str, tuple[int, ...]]  # parameter FQN -> full shape, in named_parameters order
    ties: list[list[str]]  # tied name groups
    experts: tuple[str, ...]  # FQNs of the routed experts' modules (GroupedExperts): sharded over ep when ep > 1
    moe: dict[str, object]  # FQN of every MoE block -> its MoEArgs
    containers: tuple[str, ...] = ()  # the stage's direct children that never run forward (ModuleDict / ModuleList)


def _meta_model(spec, args):
    key = (spec.name, repr(args))
    if key not in _MODELS:
        if len(_MODELS) > 8:
            _MODELS.clear()
        _MODELS[key] = spec.build_meta(args)
    return _MODELS[key]


def _stage(args, names: tuple[str, ...]) -> StageFacts:
    """The facts of the stage holding ``names``: the model's own constructor on the meta device, cut by the
    pipeline's stage builder, ties found by identity, expert and MoE modules found by type."""
    from titanlike.models.moe import GroupedExperts, MoE
    from titanlike.parallel.fsdp import runs_forward
    from titanlike.parallel.pipeline import build_stage
    from titanlike.parallel.ties import tie_groups

    spec = _spec(args)
    key = (spec.name, repr(args), names)
    if key not in _STAGES:
        stage = build_stage(_meta_model(spec, args), names)
        mods = list(stage.named_modules())
        _STAGES[key] = StageFacts(
            {k: tuple(p.shape) for k, p in stage.named_parameters()},
            tie_groups(stage),
            tuple(n for n, m in mods if isinstance(m, GroupedExperts)),
            {n: m.args for n, m in mods if isinstance(m, MoE)},
            tuple(n for n, m in stage.named_children() if not runs_forward(m)),
        )
    return _STAGES[key]


def moe_layers(args, names: Sequence[str]) -> dict[int, object]:
    """Layer id -> MoEArgs of every block among module ``names`` (a stage's) that holds an MoE block: the decoder
    blocks (``layers.N``) and the blocks the output modules run (the spec's ``prediction_blocks``: MTP depths)."""
    blocks = _spec(args).prediction_blocks(args)
    out = {}
    for fqn, a in _stage(args, tuple(names)).moe.items():
        if fqn.startswith("layers."):
            out[int(fqn.split(".")[1])] = a
        else:
            out[next(i for b, i in blocks.items() if fqn.startswith(b + "."))] = a
    return out


def prediction_blocks(args, names: Sequence[str]) -> dict[str, int]:
    """FQN -> layer id of the prediction blocks (MTP depths, ``ModelSpec.prediction_blocks``) among the output
    modules of ``names`` (a stage's)."""
    return {b: i for b, i in _spec(args).prediction_blocks(args).items() if b.split(".")[0] in names}


def param_shapes(args, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Full shapes of the parameters of a stage holding modules ``names`` (the model's own FQNs, in
    ``named_parameters`` order; a tied head inside the stage is the embedding's parameter)."""
    return dict(_stage(args, tuple(names)).shapes)


@dataclass(frozen=True)
class ParamShard:
    name: str
    shape: tuple[int, ...]  # full
    tp_shape: tuple[int, ...]  # after tensor parallelism: what FSDP all-gathers
    local_shape: tuple[int, ...]  # what this rank stores
    padded_numel: int  # FSDP's per-rank all-gather share (dim 0 padded to ceil(n / dp_shard))
    # FSDP's shard group when it is not the layout's (``Layout.fsdp_dim``): the routed experts' "dp_shard_mod_ep"
    # (their tp_shape is then this ep rank's experts), an MoE block's "dp_shard_cp_tp" when ep borrows tp
    group: str = ""

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
    """Per stage held by ``rank``: its parameters' full, tp-local (ep-local for routed experts) and stored shapes.

    Under expert parallelism (``titanlike.parallel.parallelize``): a routed expert weight ``(E, ., .)`` is
    ``Shard(0)`` over ``ep`` (this ep rank's ``E / ep`` experts), then FSDP over ``dp_shard_mod_ep`` on dim 0 when its
    experts divide by that group, else dim 1; when ep borrows tp, the rest of an MoE block (router, shared experts)
    is replicated over tp and FSDP-sharded over ``dp_shard x cp x tp``."""
    from titanlike.parallel.expert_parallel import expert_fsdp_dim

    c = layout.coords(rank)
    ds, shard_index = layout.fsdp_shard, layout.fsdp_shard_index(c)
    token = layout.token_index(c)
    ep_rank, mod_rank = token % layout.ep, token // layout.ep
    out = {}
    sharding = _spec(args).sharding_of(args)
    for s in layout.stage_ids(c["pp"]):
        shards = []
        facts = _stage(args, tuple(layout.stages[s]))
        for name, shape in facts.shapes.items():
            owner = name.rpartition(".")[0]
            tp_shape = list(shape)
            if layout.ep > 1 and owner in facts.experts:
                tp_shape[0] = chunk(shape[0], layout.ep, ep_rank)
                m = layout.dp_shard_mod_ep
                fd = expert_fsdp_dim(tp_shape[0], m)
                group, size, index = "dp_shard_mod_ep", m, mod_rank
            elif layout.ep_tp > 1 and any(owner == b or owner.startswith(b + ".") for b in facts.moe):
                fd, group, size, index = 0, "dp_shard_cp_tp", ds * layout.tp, token
            else:
                d, fd = param_dims(sharding, name, len(shape), tp=layout.tp, fsdp=layout.fsdp)
                if d is not None:
                    tp_shape[d] = chunk(shape[d], layout.tp, c["tp"])
                group, size, index = "", (ds if layout.fsdp else 0), shard_index
            local, padded = list(tp_shape), _prod(tp_shape)
            if size:
                local[fd] = chunk(tp_shape[fd], size, index)
                padded = -(-tp_shape[fd] // size) * _prod(tp_shape) // max(1, tp_shape[fd])
            shards.append(ParamShard(name, tuple(shape), tuple(tp_shape), tuple(local), padded, group))
        out[s] = shards
    return out


def fsdp_units(
    layout: Layout, args, shards: list[ParamShard], names: Sequence[str]
) -> list[tuple[str, list[ParamShard]]]:
    """FSDP groups of one stage module as titanlike.parallel.fsdp.apply_fsdp builds them: (kind, params) with kind
    "block", "embedding", "head" or "root"; groups without parameters are left out. Under expert parallelism each
    block's routed experts come first as their own "experts" group (``apply_expert_fsdp``), and when ep borrows tp
    the rest of its MoE block as a "moe" group (``apply_moe_token_fsdp``). Which of them FSDP wraps, over which
    ranks: :func:`unit_group`."""
    by_name = {p.name: p for p in shards}
    spec = _spec(args)
    stage = _stage(args, tuple(names))
    inputs = [n for n in spec.input_modules if n in names]
    outputs = [n for n in spec.output_modules if n in names]
    # apply_fsdp leaves a parameter the input and output modules share (a tied embedding / head) to the root
    owners = [{name.split(".")[0] for name in group} for group in stage.ties]
    tied_owners = set().union(*(o for o in owners if o & set(inputs) and o & set(outputs)))
    tied = bool(tied_owners)
    # and a container (no forward of its own: DeepSeek-V3's mtp depths)
    inputs = [n for n in inputs if n not in stage.containers]
    outputs = [n for n in outputs if n not in stage.containers]
    units: list[tuple[str, list[ParamShard]]] = []
    taken: set[str] = set()

    def add(kind, prefixes):
        params = [p for p in shards if p.name.startswith(prefixes) and p.name not in taken]
        taken.update(p.name for p in params)
        if params:
            units.append((kind, params))

    def moe_units(block):  # apply_expert_fsdp's and apply_moe_token_fsdp's groups of every MoE block
        for kind, group in (("experts", "dp_shard_mod_ep"), ("moe", "dp_shard_cp_tp")):
            inside = [p for p in shards if p.group == group and p.name.startswith(block + ".")]
            if inside:
                taken.update(p.name for p in inside)
                units.append((kind, inside))

    for name in names:
        if name.startswith("layers."):
            moe_units(name)
            add("block", (name + ".",))
    for block in prediction_blocks(args, names):  # an MTP depth's block: no group of its own, its MoE's groups
        moe_units(block)
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


def unit_group(layout: Layout, params: list[ParamShard]) -> tuple[str, int] | None:
    """(mesh dim, ranks) FSDP shards the group ``params`` over, or None when FSDP does not wrap it (one rank per
    model copy: the routed experts and MoE blocks under ep are always wrapped)."""
    group = params[0].group
    if group == "dp_shard_mod_ep":
        return group, layout.dp_shard_mod_ep
    if group == "dp_shard_cp_tp":
        return group, layout.fsdp_shard * layout.tp
    return (layout.fsdp_dim, layout.fsdp_shard) if layout.fsdp else None


def unit_reshards(layout: Layout, kind: str) -> bool:
    """Whether FSDP frees the group's gathered parameters after its forward: the experts' and MoE groups follow the
    blocks' policy (``titanlike.parallel.parallelize``)."""
    return layout.reshard("block" if kind in ("experts", "moe") else kind)


# ------------------------------------------------------------------------------------------------- activations
def cp_a2a_group(layout: Layout) -> int:
    """The ranks an all-to-all over heads spans: the whole cp group (``alltoall``), hybrid's groups of
    ``context_parallel_a2a_degree`` (``hybrid``)."""
    return layout.cp_a2a if layout.cp_method == "hybrid" else layout.cp


def cp_head_widths(layout: Layout, args) -> dict[str, int]:
    """Numbers per token of one tp rank's query, key, value and output heads as an all-to-all over heads moves them
    (``titanlike.parallel.context_parallel.UlyssesAttention``, ``HybridAttention``): the kv heads repeated to a
    multiple of the all-to-all group (:func:`cp_a2a_group`) where it does not divide them; MLA's per-head keys /
    values after the up-projection (qk_head_dim / v_head_dim wide)."""
    from titanlike.parallel.context_parallel import ulysses_kv_heads

    heads = args.n_heads // layout.tp
    kv = ulysses_kv_heads(heads, args.n_kv_heads // layout.tp, cp_a2a_group(layout))
    qk, vd = getattr(args, "qk_head_dim", args.head_dim), getattr(args, "v_head_dim", args.head_dim)
    return {"q": heads * qk, "k": kv * qk, "v": kv * vd, "out": heads * vd}


def cp_kv_bytes(layout: Layout, args, method: str | None = None) -> int:
    """Bytes of keys and values one softmax layer's attention kernel reads on a rank for one microbatch under
    context-parallel ``method`` (default: the layout's), as the cores run it (kv heads repeated to the query heads;
    MLA's per-head keys and values expanded): ``allgather`` the whole sequence's K and V of this tp rank's heads;
    ``alltoall`` the whole sequence's of ``heads / cp`` of them (1 / cp of that); ``ring`` one visiting pair of
    chunks of every head (1 / cp) and the next pair arriving meanwhile (kv heads; MLA: the latent and the RoPE
    key, each visiting block expanded where it is used)."""
    heads = args.n_heads // layout.tp
    qk, vd = getattr(args, "qk_head_dim", args.head_dim), getattr(args, "v_head_dim", args.head_dim)
    whole = layout.microbatch_size * layout.seq_len * heads * (qk + vd) * layout.act_bytes
    method = method or layout.cp_method
    if method == "ring":  # one visiting pair of chunks (repeated to the heads) and the next pair arriving (kv heads;
        latent = getattr(args, "cp_gathered", None)  # MLA: the latent and the RoPE key, expanded where used)
        width = sum(w for _, w in latent) if latent else (args.n_kv_heads // layout.tp) * (qk + vd)
        arriving = layout.microbatch_size * layout.local_seq_len * width
        return whole // layout.cp + arriving * layout.act_bytes
    if method == "hybrid":  # a visiting group's 2 a2a chunks of heads / a2a heads and the next group's arriving
        widths = cp_head_widths(layout, args)
        arriving = layout.microbatch_size * layout.local_seq_len * (widths["k"] + widths["v"])
        return whole // layout.cp + arriving * layout.act_bytes
    return whole // layout.cp if method == "alltoall" else whole


def _kept_kv_width(layout: Layout, args) -> int:
    """The K (and V) width per token, over every tp rank, that SDPA keeps for its backward: the kv heads (grouped-
    query attention reads them in place); every head's under the all-gather and ring context-parallel cores, which
    repeat them; a multiple of cp of them under the all-to-all."""
    if layout.cp > 1 and layout.cp_method in ("alltoall", "hybrid"):
        return cp_head_widths(layout, args)["k"] * layout.tp
    return args.n_heads * args.head_dim if layout.cp > 1 else args.n_kv_heads * args.head_dim


def _cp_kernel_bytes(layout: Layout, args, mode: str) -> float:
    """Bytes per local token a softmax attention kernel keeps under context parallelism beyond the one-device
    formula of :func:`block_activation_bytes`, by ``layout.cp_method``.

    All-gather: the kernel keeps K and V of the whole sequence, repeated to all heads as its inputs (no AC:
    (cp - 1) more tokens' worth than the local K / V); the kernels of the two chunks also keep their outputs,
    besides the concatenated output (``a q_w``); selective op AC saves the all-gather outputs instead (kv heads)
    and recomputes the rest. All-to-all over heads (Ulysses): the kernel holds the whole sequence of heads / cp
    heads, the size of the local tokens of every head, so no extra K / V; selective op AC saves the four
    all-to-alls' outputs. A ring (CPU math path): its function keeps q, k, v (kv heads, not repeated), the output
    and a log-sum-exp in the activation dtype: the float32 log-sum-exp's excess only. Under selective op AC the
    checkpoint saves the matmul outputs inside it instead of an attention kernel's output: every visible block
    pair's scores and output (2 cp + 1 pairs of C x (C + v) per head under the causal mask; fewer under a window,
    not counted). Hybrid: the ring's, plus the all-to-all's q, k, v the ring function keeps (no AC: ``a q_w``) or the
    four all-to-alls' outputs op AC saves (pinned against the dry run's probe)."""
    n, a, t = args.n_heads, layout.act_bytes, layout.tp
    q_w, kv_w = n * args.head_dim, args.n_kv_heads * args.head_dim
    if layout.cp_method in ("ring", "hybrid"):  # hybrid: the same pairs per head, a ring rank holding more heads
        c_len, vd = layout.local_seq_len // 2, getattr(args, "v_head_dim", args.head_dim)
        if mode == "none":  # hybrid: the ring function keeps the all-to-all's q, k, v, the local ones still kept
            return (a - 4) * n / t + (a * q_w / t if layout.cp_method == "hybrid" else 0)
        if mode == "op":  # hybrid: op AC saves its four all-to-alls' outputs too
            saved = a * sum(cp_head_widths(layout, args).values()) if layout.cp_method == "hybrid" else 0
            return (2 * layout.cp + 1) / 2 * a * n / t * (c_len + vd) - (a * q_w / t + 4 * n / t) + saved
        return 0.0
    if layout.cp_method == "alltoall":
        return a * (q_w / t if mode == "none" else sum(cp_head_widths(layout, args).values()) if mode == "op" else 0)
    if mode == "none":
        return 2 * a * q_w / t * (layout.cp - 1) + a * q_w / t
    if mode == "op":
        return 2 * a * kv_w / t * layout.cp
    return 0.0


def block_activation_bytes(
    layout: Layout, args, tokens: int, mode: str = "none", moe=None, *, probe: bool = False, layer_id: int = 0
) -> int:
    """Bytes one transformer block keeps for its backward, for ``tokens`` tokens of one microbatch.

    The block's structure comes from its model spec (``norm_kind``, ``mlp_kind``; per-head q/k norms where its
    sharding has ``HeadNorm`` entries) and its args (attention widths ``n_heads x head_dim`` and
    ``n_kv_heads x head_dim``, which need not be the model dim): Llama (RMSNorm upcast to float32, SwiGLU), GPT-2
    (LayerNorm, fused q|k|v, GELU MLP), Qwen3-like blocks (QK-norm); each equals the planner's dry-run probe
    (FakeTensorMode). ``moe``: the block's ``MoEArgs`` when its feed-forward is an MoE block (:func:`moe_layers`),
    whose term (:func:`moe_activation_bytes`) replaces the SwiGLU's."""
    h, H, n, kv_n = args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads
    q_w, kv_w = n * args.head_dim, kv_n * args.head_dim  # attention widths (= h for Llama and GPT-2)
    a, c, t = layout.act_bytes, layout.compute_bytes, layout.tp
    tsp = t if layout.sequence_parallel else 1
    spec = _spec(args)
    gelu = spec.mlp_kind == "gelu"
    layer_norm = spec.norm_kind == "layer"
    zero_centred = spec.norm_kind == "rms_zero_centred"  # also keeps its float32 output and 1 + w (constant)
    qk_norm = any(isinstance(e, HeadNorm) for e in spec.sharding_of(args).values())
    # a model's own attention (MLA's latents): its hook's bytes per token replace the softmax formula's below
    sizes = ActivationSizes(mode, a, c, t, layout.local_seq_len, probe, layout.microbatch_size, layout.cp)
    own = spec.attention_activations(args, layer_id, sizes) if mode != "full" else None
    linear = spec.linear_attention(args, layer_id) is not None  # state passing: no K / V (its hook counts the maps)
    gathered_kv = 0.0 if linear or layout.cp == 1 else _cp_kernel_bytes(layout, args, mode)
    if mode == "full":
        per_token = a * h / tsp
    elif mode == "op":
        # the projections' outputs: q, k, v (GPT-2's fused c_attn alike), wo's local partial, the MLP's (SwiGLU: w1,
        # w3, w2's partial; GELU: c_fc, c_proj's partial)
        mm = (1 if gelu else 2) * a * H / t + a * h
        attention = a * (q_w + 2 * kv_w) / t + a * h + a * q_w / t + 4 * n / t if own is None else own
        if t > 1 and layout.sequence_parallel:
            coll = 2 * a * h + 2 * a * h / t  # all-gathers before attention / ffn, reduce-scatters after
        elif t > 1:
            coll = 2 * a * h  # all-reduces after wo / w2
        else:
            coll = 0
        per_token = a * h / tsp + mm + attention + coll
    else:
        # a norm keeps its input and statistics (RMSNorm: the float32 upcast and rstd; LayerNorm: the input and
        # 4 bytes of statistics), its output (the projection's input, all-gathered under SP); q, k, v, the
        # attention output and its log-sum-exp; the MLP's hidden activations (SwiGLU: 4, GELU: 2); per-head q / k
        # RMSNorms: their float32 input, one rstd per head and their output (for the weight's gradient)
        norm = (a * h + 4) if layer_norm else (c * h + c + (c if zero_centred else a) * h)
        norms = 2 * (norm / tsp + a * h)
        # q, k and v as SDPA keeps them (grouped-query heads read in place: kv width; the all-gather and the ring
        # cores repeat them to every head, the all-to-all only to the kv heads cp divides), the output; the
        # log-sum-exp
        attention = 2 * a * q_w + 2 * a * _kept_kv_width(layout, args) + 4 * n
        if qk_norm:
            attention += (c + a) * (q_w + kv_w) + c * (n + kv_n)
        attention = attention / t if own is None else own
        per_token = norms + attention + (2 if gelu else 4) * a * H / t
    constant = 2 * c * h if zero_centred and mode == "none" else 0  # the two norms' 1 + w
    if moe is None:
        return round((per_token + gathered_kv) * tokens) + constant
    # the dense feed-forward's share above out, the MoE block's in (it runs on this rank's own tokens: 1 / t_sp)
    # (and under SP the feed-forward's input is not all-gathered, nor its output reduce-scattered: one collective
    # pair less for op AC, the norm's output kept at local length)
    ag = (a * h - a * h / tsp) if tsp > 1 else 0  # the norm output's gathered part (none) ...
    coll = (a * h + a * h / tsp) if tsp > 1 else 0  # ... and the all-gather / reduce-scatter pair (op AC)
    ffn = {
        "full": 0,
        "op": (1 if gelu else 2) * a * H / t + a * h + coll,
        "none": (2 if gelu else 4) * a * H / t + ag,
    }[mode]
    routed = tokens // tsp
    return (
        round((per_token - ffn + gathered_kv) * tokens)
        + constant
        + moe_activation_bytes(layout, moe, routed, mode, probe=probe)
    )


def moe_activation_bytes(layout: Layout, m, tokens: int, mode: str = "none", *, probe: bool = False) -> int:
    """Bytes an MoE block (``m``: its MoEArgs) keeps for its backward when it routes ``tokens`` tokens, every expert
    the same load (the planner's balanced routing), read off ``titanlike.models.moe`` and checked against the
    dry run's probe. Per token, with ``k = top_k``, ``E`` experts, ``H`` per expert, ``H_s`` the shared width, ``a``
    the activation bytes and ``c`` the router's compute bytes: ``none``: the router's scores ``c E``, the picked ids
    and the sort's two index vectors ``3 x 8 k``, the routing weights ``c k`` (``c k + c`` more when renormalised),
    the sorted rows ``a h k``, each expert's SwiGLU ``4 a H k``, the combine's upcast rows ``c h k``, the shared
    experts' ``4 a H_s`` (the aux loss: ``c`` more, and ``c E`` per sequence); expert parallelism adds the
    regrouping's two index vectors ``2 x 8 k``. Selective op: the router's logits ``a E``, each routed row's three
    matmul outputs ``k (2 a H + a h)``, the shared experts' ``2 a H_s + a h``, and under expert parallelism the
    dispatch and combine outputs ``2 a h k``. Full: nothing beyond the block input. Every mode keeps the block's
    token counts (``8 E``: the load statistics). Under ep the experts' side (the rows this rank computes) is the
    busiest rank's: ``layout.expert_imbalance`` x the mean. ``probe``: without the expert-parallel terms (the dry
    run's probe cannot run the dispatch on fake tensors)."""
    a, c, h, k, E = layout.act_bytes, layout.compute_bytes, m.dim, m.top_k, m.num_experts
    ep = layout.ep > 1 and not probe
    shared = m.shared_width
    # what the experts' side keeps scales with the rows this rank computes: the busiest rank's under ep
    busy = layout.expert_imbalance if ep else 1.0
    if mode == "full":
        per_token = 0.0
    elif mode == "op":
        experts = k * (2 * a * m.hidden_dim + a * h) + (a * h * k if ep else 0)  # + the dispatch's output
        per_token = a * E + busy * experts + (2 * a * shared + a * h if shared else 0) + (a * h * k if ep else 0)
        per_token += a if m.shared_gate and shared else 0  # the gate's projection
    else:
        experts = a * h * k + 4 * a * m.hidden_dim * k + (16 * k if ep else 0)
        per_token = c * E + 24 * k + c * k + (c * k + c if m.route_norm else 0) + busy * experts
        per_token += c * h * k + 4 * a * shared + (c if m.aux_loss_coeff > 0 else 0)
        per_token += a + a * h if m.shared_gate and shared else 0  # sigmoid(x w) and the shared output it scales
    sequences = layout.microbatch_size
    aux = m.aux_loss_coeff > 0  # its running sum (a scalar), and per sequence the counts' coefficients
    constant = 8 * E + (c if aux else 0) + (c * E * sequences if aux and mode == "none" else 0)
    return round(per_token * tokens) + constant


def prediction_activation_bytes(layout: Layout, args, names: Sequence[str], tokens: int, *, probe: bool = False) -> int:
    """Bytes the prediction depths (MTP, ``ModelSpec.prediction_blocks``) held by a stage of module ``names`` keep
    for their backward, for ``tokens`` tokens. Per depth and token: the ids ahead (int64, saved by the embedding),
    the embedding's and the hidden state's RMSNorms (the hidden state's input is the final norm's output, already
    held, unless upcast to float32 or, under SP, the local part beside the head's gathered input), their
    concatenation ``2 a h`` (saved by the projection), the depth's block (:func:`block_activation_bytes`; no AC
    wraps it), its norm, the shared head's input and logits (:func:`head_activation_bytes`' kept part). Checked
    against the saved tensors of a real forward (tests/planner/test_planner_mla.py)."""
    blocks = prediction_blocks(args, names)
    if not blocks:
        return 0
    a, c, h = layout.act_bytes, layout.compute_bytes, args.dim
    tsp = layout.tp if layout.sequence_parallel else 1
    h_in = c * h if a < c else (a * h if tsp > 1 else 0)
    combine = 8 + ((c * h + c + a * h) + (h_in + c + a * h) + 2 * a * h) / tsp
    kept, _ = head_activation_bytes(layout, args, tokens)
    moe = moe_layers(args, names)
    return sum(
        round(combine * tokens)
        + block_activation_bytes(layout, args, tokens, "none", moe.get(i), probe=probe, layer_id=i)
        + kept
        for i in blocks.values()
    )


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
    experts = [p for ps in shards.values() for p in ps if p.group == "dp_shard_mod_ep"]
    if experts:  # the routed experts' share: this ep rank's experts, sharded over the ranks holding the same ones
        n_exp = sum(p.numel for p in experts)
        sharded += (
            f"; routed experts {fmt_gib(n_exp * pb)} of it ({experts[0].tp_shape[0]} of {experts[0].shape[0]} "
            f"experts per layer on this ep rank of {layout.ep}, sharded over dp_shard_mod_ep {layout.dp_shard_mod_ep})"
        )
    items = [
        MemoryItem("parameters", n_local * pb, f"{n_local / 1e6:,.1f}M elements, fp{8 * pb} master copy, {sharded}"),
        MemoryItem("gradients", n_local * pb, f"fp{8 * pb}, same shards"),
        _optimizer_item(layout, args, shards, n_local, n_tensors),
    ]
    if layout.cpu_offload:  # FSDP's CPUOffloadPolicy: the three live in host memory (rank_host_memory)
        items = [MemoryItem(it.name, 0.0, f"in host memory ({fmt_gib(it.bytes)}): {it.note}") for it in items]
    # Gathered parameters / unsharded gradients.
    stage_units = {
        s: [(k, ps) for k, ps in fsdp_units(layout, args, ps, layout.stages[s]) if unit_group(layout, ps)]
        for s, ps in shards.items()
    }
    if any(stage_units.values()):
        resident = [u for units in stage_units.values() for u in units if not unit_reshards(layout, u[0])]
        blocks = [u for units in stage_units.values() for u in units if unit_reshards(layout, u[0])]
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
    if layout.distributed_optimizer:  # ZeRO-1: the moments' rows split over the replicated ranks (torch.chunk)
        r = layout.dp_replicate
        return MemoryItem(
            "optimizer",
            2 * sum(-(-p.numel // r) for ps in shards.values() for p in ps) * pb + 4 * n_tensors,
            f"AdamW exp_avg + exp_avg_sq sharded over dp_replicate {r} (ZeRO-1) (+ step scalars)",
        )
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


def rank_host_memory(layout: Layout, args, rank: int = 0) -> list[MemoryItem]:
    """What ``rank`` keeps in host memory under the offload modes: the parameter shards, their gradients and the
    optimizer state (training.enable_cpu_offload, pinned on CUDA), and the saved activations of the blocks AC leaves
    alone (activation_checkpoint.offload; the device keeps the two blocks in flight)."""
    items = []
    if layout.cpu_offload:
        off = dataclasses.replace(layout, cpu_offload=False)
        items += [
            it for it in rank_state_memory(off, args, rank) if it.name in ("parameters", "gradients", "optimizer")
        ]
    if layout.act_offload:
        items.append(MemoryItem("offloaded activations", offloaded_activation_bytes(layout, args, rank)[0]))
    return items


def offloaded_activation_bytes(layout: Layout, args, rank: int = 0) -> tuple[float, float]:
    """Activation offload: (the bytes the blocks AC leaves alone save, moved to the host; the two largest such
    blocks', on the device together in the backward: the block it runs and the one brought back ahead of it)."""
    if not layout.act_offload:
        return 0.0, 0.0
    tokens = layout.microbatch_size * layout.local_seq_len
    per_block = []
    for s in layout.stage_ids(layout.coords(rank)["pp"]):
        moe = moe_layers(args, layout.stages[s])
        ids = [int(n.split(".")[1]) for n in layout.stages[s] if n.startswith("layers.")]
        per_block += [
            block_activation_bytes(layout, args, tokens, "none", moe.get(i), layer_id=i)
            for i in ids
            if layout.checkpointed(i) == "none"
        ]
    return float(sum(per_block)), float(sum(sorted(per_block)[-2:]))


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
        moe = moe_layers(args, layout.stages[s])
        per_mb = sum(
            block_activation_bytes(layout, args, tokens, layout.checkpointed(i), moe.get(i), layer_id=i) for i in ids
        )
        if "output" in layout.stages[s]:
            kept, tr = head_activation_bytes(layout, args, tokens)
            per_mb += kept + prediction_activation_bytes(layout, args, layout.stages[s], tokens)
            transient = max(transient, tr)
        act += count * per_mb
        detail.append(f"{count} x stage {s}" if layout.pp > 1 else "1 microbatch")
        if any(layout.checkpointed(i) != "none" for i in ids):
            recompute = max(
                block_activation_bytes(layout, args, tokens, "none", moe.get(i), layer_id=i)
                - block_activation_bytes(layout, args, tokens, layout.checkpointed(i), moe.get(i), layer_id=i)
                for i in ids
            )
            transient = max(transient, recompute)
    offloaded, in_flight = offloaded_activation_bytes(layout, args, rank)
    if offloaded:  # (one microbatch in flight without pp; under pp every microbatch's blocks alike)
        act -= sum(counts) * (offloaded - in_flight)
        detail.append(f"offloaded to host {fmt_gib(offloaded)} per microbatch")
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


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _dtype(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32", 8: "fp64"}[nbytes]
