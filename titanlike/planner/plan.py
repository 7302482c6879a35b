"""One configuration, fully planned: validation, rank map, price per step, memory per rank, dry run; as text."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from titanlike.config import JobConfig, setting_problems
from titanlike.layout import FLATTENED, MESH_DIMS, describe_split, layout_violations
from titanlike.models import get_spec
from titanlike.models.masking import cp_gathered_tokens
from titanlike.planner.cost import StepCost, messages, ring_hops, ring_payload, step_cost
from titanlike.planner.dryrun import DryRun, dry_run
from titanlike.planner.hardware import GiB, Hardware
from titanlike.planner.layout import Layout
from titanlike.planner.memory import (
    MemoryItem,
    block_activation_bytes,
    cp_head_widths,
    cp_kv_bytes,
    moe_layers,
    rank_memory,
    rank_param_shards,
)
from titanlike.planner.muon import muon_rank

__all__ = ["Plan", "make_plan", "render_plan", "fmt_bytes", "fmt_seconds"]


@dataclass
class Plan:
    cfg: JobConfig
    args: object  # ModelArgs
    hardware: Hardware
    world_size: int
    violations: list[str]
    layout: Layout | None = None
    warnings: list[str] = field(default_factory=list)
    cost: StepCost | None = None
    memory: dict[int, list[MemoryItem]] = field(default_factory=dict)  # rank -> items
    rank: int = 0
    dry: DryRun | None = None

    @property
    def legal(self) -> bool:
        return not self.violations

    def total_memory(self, rank: int) -> float:
        return sum(it.bytes for it in self.memory[rank])

    @property
    def peak_rank(self) -> int:
        return max(self.memory, key=self.total_memory)

    @property
    def fits(self) -> bool:
        """The most loaded rank fits in the usable memory (False when nothing was sized: an illegal layout)."""
        return bool(self.memory) and self.total_memory(self.peak_rank) <= self.hardware.usable_memory


def make_plan(
    cfg: JobConfig,
    world_size: int,
    hardware: Hardware,
    args,
    *,
    rank: int = 0,
    run_dry: bool = True,
    attention_fraction: float = 1.0,
    expert_imbalance: float = 1.0,
) -> Plan:
    """Validate ``cfg`` for ``world_size`` ranks of ``hardware`` and, if it is legal, price, size and dry-run it.
    ``attention_fraction``: under ``block_causal`` the share of the causal attention the mask computes on the corpus
    (``titanlike.data.documents.document_stats``); ``expert_imbalance``: the busiest expert-parallel rank's load over
    the mean (>= 1; 1 is the balance the bias update steers to)."""
    violations = setting_problems(cfg) + layout_violations(cfg, world_size, args)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    plan = Plan(cfg, args, hardware, world_size, violations, rank=rank)
    if violations:
        return plan
    lo = plan.layout = Layout.from_config(
        cfg, world_size, args, hardware.gpus_per_node, attention_fraction, expert_imbalance
    )
    for dim in ("tp", "cp", "ep"):
        if dim not in lo.groups:  # ep: only under expert parallelism
            continue
        gm = lo.groups[dim]
        if gm.spanning:
            shown = "; ".join(_ranks(g) for g in gm.spanning[:4])
            more = f" (and {len(gm.spanning) - 4} more)" if len(gm.spanning) > 4 else ""
            plan.warnings.append(
                f"{len(gm.spanning)} of {gm.n_groups} {dim} groups span nodes: {shown}{more}; every "
                f"layer's {dim} collectives then ride the inter-node network; keep {dim} <= "
                f"gpus_per_node ({lo.gpus_per_node}) and a divisor of it"
            )
    plan.cost = step_cost(lo, args, hardware, rank)
    per_pp = lo.world_size // lo.pp
    for r in sorted({rank} | {p * per_pp for p in range(lo.pp)}):
        plan.memory[r] = rank_memory(lo, args, r)
    if not plan.fits:
        r = plan.peak_rank
        plan.warnings.append(
            f"memory: rank {r} needs {plan.total_memory(r) / GiB:.1f} GiB, more than the "
            f"{hardware.usable_memory / GiB:.1f} GiB usable on a {hardware.gpu}; see the memory "
            f"section (activation checkpointing, smaller microbatches, more pp/tp)"
        )
    if run_dry:
        plan.dry = dry_run(cfg, lo, args, rank)
    return plan


# ------------------------------------------------------------------------------------------------------ text
def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ranks(group) -> str:
    g = list(group)
    if len(g) > 2 and all(b - a == g[1] - g[0] for a, b in zip(g, g[1:])):
        step = g[1] - g[0]
        return f"[{g[0]}..{g[-1]}{'' if step == 1 else f' step {step}'}]"
    return "[" + ",".join(map(str, g)) + "]"


def _flops(f: float) -> str:
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12)):
        if f >= size:
            return f"{f / size:.2f} {unit}"
    return f"{f / 1e9:.2f} GFLOP"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _header(plan: Plan) -> list[str]:
    cfg, args, hw = plan.cfg, plan.args, plan.hardware
    n_nodes = -(-plan.world_size // hw.gpus_per_node)
    active = getattr(args, "num_active_params", None)  # a model with experts: what one token uses
    active_note = f" ({active() / 1e9:.2f}B active per token)" if active is not None else ""
    lines = [
        f"titanlike layout plan: {cfg.model.name}/{cfg.model.flavor} ({args.num_params() / 1e9:.2f}B parameters"
        f"{active_note}, "
        f"{args.n_layers} layers, dim {args.dim}, {args.n_heads} heads / {args.n_kv_heads} kv, vocab "
        f"{args.vocab_size}) on {plan.world_size:,} x {hw.gpu} ({n_nodes:,} node{'s' * (n_nodes > 1)} of "
        f"{hw.gpus_per_node})"
    ]
    lines.append(
        f"  links per GPU and direction: NVLink {hw.nvlink_bw / 1e9:.0f} GB/s inside a node, network "
        f"{hw.network_bw / 1e9:.0f} GB/s between nodes; peak {hw.peak_flops / 1e12:.0f} TFLOP/s "
        f"({cfg.training.dtype}), kernels at {hw.compute_efficiency:.0%} of it; "
        f"{hw.memory_bytes / GiB:.1f} GiB memory"
    )
    lo = plan.layout
    if lo is not None:
        sched = (
            (
                f" ({lo.schedule}, {lo.stages_per_rank} stage{'s' * (lo.stages_per_rank > 1)}/rank, "
                f"{len(lo.stages)} stages)"
            )
            if lo.pp > 1
            else ""
        )
        lines.append(
            f"  layout: tp {lo.tp}{' +SP' if lo.sequence_parallel else ''} x pp {lo.pp}{sched} x dp_shard "
            f"{lo.dp_shard} x dp_replicate {lo.dp_replicate} x cp {lo.dims.cp}"
            + (
                f" (ep {lo.ep} from dp_shard x cp{' x tp' if lo.ep_tp > 1 else ''}, experts FSDP over the other "
                f"{lo.dp_shard_mod_ep})"
                if lo.ep > 1
                else ""
            )
            + f"; AC {_ac(lo)}; "
            f"FSDP reshard after forward: {lo.reshard_after_forward}"
        )
        if lo.pp > 1:
            lines.append(f"  pipeline split: {describe_split(lo.stages, spec=get_spec(cfg.model.name))}")
        lines.append(
            f"  batch: {lo.global_batch:,} x {lo.seq_len:,} = {lo.tokens_per_step:,} tokens per step; "
            f"{lo.global_batch // (lo.dp * lo.accum_steps)} sequences per dp rank per pass, microbatch "
            f"{lo.microbatch_size} -> {lo.n_microbatches} microbatch{'es' * (lo.n_microbatches > 1)}, "
            f"{lo.accum_steps} accumulation step{'s' * (lo.accum_steps > 1)}"
        )
    return lines


def _ac(lo: Layout) -> str:
    return lo.ac_mode if lo.ac_mode != "selective" else f"selective {lo.ac_option}"


def _validation(plan: Plan) -> list[str]:
    out = ["", "== validation"]
    if plan.violations:
        out.append(f"  {len(plan.violations)} violation{'s' * (len(plan.violations) > 1)}:")
        out += [f"  - {v}" for v in plan.violations]
    else:
        out.append("  OK: every layout rule holds (titanlike.layout.layout_violations)")
    out += [f"  WARNING: {w}" for w in plan.warnings]
    return out


def _map(plan: Plan) -> list[str]:
    lo = plan.layout
    gpn = lo.gpus_per_node
    out = [
        "",
        "== map",
        f"  rank = (((pp * {lo.dp_replicate} + dp_replicate) * {lo.dp_shard} + dp_shard) * {lo.dims.cp} + cp) * "
        f"{lo.tp} + tp;  node = rank // {gpn};  {lo.n_nodes:,} nodes",
        f"  {'dim':<16}{'size':>6}{'stride':>8}{'groups':>8}  {'nodes/group':>11}  link     rank {plan.rank}'s group",
    ]
    names = ("tp", "cp", "dp_shard", "dp_shard_cp", "dp_replicate", "dp", "pp", *lo.expert_rows)
    for name in names:
        gm = lo.groups[name]
        if name == "dp_shard_cp" and 1 in (lo.dp_shard, lo.cp):
            continue
        if gm.size == 1 or (name == "dp" and 1 in (lo.dp_shard, lo.dp_replicate)):
            continue
        mine = _group_of(lo, name, plan.rank)
        out.append(
            f"  {name:<16}{gm.size:>6}{gm.stride:>8}{gm.n_groups:>8}  {gm.max_nodes:>11}  {gm.link:<8} {_ranks(mine)}"
        )
    if all(lo.groups[n].size == 1 for n in ("tp", "cp", "dp", "pp")):
        out.append("  single rank: nothing to map")
    tp = lo.groups["tp"]
    out.append(
        f"  tp groups {'stay inside a node' if not tp.spanning else 'SPAN NODES (see the warning above)'}"
        + (f"; each node holds {gpn // lo.tp} tp group(s)" if lo.tp <= gpn and not tp.spanning else "")
    )
    return out


def _group_of(lo: Layout, name: str, rank: int) -> tuple[int, ...]:
    if name in lo.expert_rows:
        rows = lo.expert_rows[name]
        return tuple(int(r) for r in rows[(rows == rank).any(axis=1)][0])
    c = lo.coords(rank)
    members = FLATTENED.get(name, (name,))
    sizes = dict(zip(MESH_DIMS, lo.dims.shape))
    stride = {d: 1 for d in MESH_DIMS}
    acc = 1
    for d in reversed(MESH_DIMS):
        stride[d] = acc
        acc *= sizes[d]
    base = rank - sum(c[m] * stride[m] for m in members)
    inner = members[-1]
    n = 1
    for m in members:
        n *= sizes[m]
    return tuple(base + i * stride[inner] for i in range(n))


def _price(plan: Plan) -> list[str]:
    """The price-per-step section: every message, each dim's time, and how the step time adds up."""
    lo, c = plan.layout, plan.cost
    out = [
        "",
        f"== price per step (rank {plan.rank}; one optimizer step)",
        f"  {'dim':<16}{'op':<15}{'phase':<9}{'count':>7}  {'message':>11}  {'wire/GPU':>11}  what",
    ]
    for m in sorted(messages(lo, plan.args, plan.rank), key=lambda m: (_DIM_ORDER.index(m.dim), -m.wire_bytes)):
        out.append(
            f"  {m.dim:<16}{m.op:<15}{m.phase:<9}{m.count:>7}  {fmt_bytes(m.nbytes):>11}  "
            f"{fmt_bytes(m.wire_bytes):>11}  {m.what}"
        )
    out.append("")
    out.append(f"  {'dim':<16}{'messages':>9}  {'wire/GPU':>11}  {'link':<10}{'time':>10}  {'exposed':>10}")
    for dim in _DIM_ORDER:
        d = c.dims.get(dim)
        if d:
            out.append(
                f"  {dim:<16}{d.messages:>9}  {fmt_bytes(d.wire_bytes):>11}  {d.link:<10}"
                f"{fmt_seconds(d.seconds):>10}  {fmt_seconds(d.exposed):>10}"
            )
    out += _compute_notes(plan) + _cp_ep_notes(plan) + _step_notes(plan)
    return out


def _compute_notes(plan: Plan) -> list[str]:
    """Megatron's TP volume, the bubble and the compute time, as checks of the table above."""
    lo, c, hw = plan.layout, plan.cost, plan.hardware
    out = []
    b, s, h, t = lo.microbatch_size, lo.seq_len, plan.args.dim, lo.tp
    if t > 1:
        per_mb = 8 * plan.args.n_layers / lo.pp * (t - 1) / t * b * s * h * lo.act_bytes
        out.append(
            f"  check: Megatron's TP volume 8 L/pp (t-1)/t b s h = {fmt_bytes(per_mb)} per microbatch x "
            f"{lo.n_microbatches * lo.accum_steps} = {fmt_bytes(per_mb * lo.n_microbatches * lo.accum_steps)}"
        )
    if lo.pp > 1:
        v, m = lo.stages_per_rank, lo.n_microbatches
        out.append(
            f"  bubble: (p-1)/(v m) = {lo.pp - 1}/({v} x {m}) = {(lo.pp - 1) / (v * m):.3f}; simulated "
            f"{lo.schedule}: {c.bubble:.3f} (idle / busy)"
        )
    out.append(
        f"  compute: {_flops(c.rank_flops)} on this rank at {hw.compute_efficiency:.0%} x "
        f"{hw.peak_flops / 1e12:.0f} TFLOP/s = {fmt_seconds(c.compute)}"
        + (" (includes recomputation)" if lo.ac_mode != "none" else "")
        + (
            f" (block_causal: attention at {lo.attention_fraction:.3f} of causal)"
            if plan.cfg.model.attn_mask_type == "block_causal"
            else ""
        )
    )
    return out


def _cp_ep_notes(plan: Plan) -> list[str]:
    """What cp's and ep's messages are per block and microbatch (synchronous: fully exposed)."""
    lo, t = plan.layout, plan.layout.tp
    out = []
    if lo.cp > 1 and lo.cp_method == "alltoall":
        widths = cp_head_widths(lo, plan.args)
        local = lo.microbatch_size * lo.local_seq_len * lo.act_bytes
        sent = sum(widths.values()) * local * (lo.cp - 1) // lo.cp
        out.append(
            f"  cp (all-to-all over heads): per block 4 all-to-alls forward (q, k, v to heads / cp heads of the "
            f"whole sequence, the output back) + 4 backward, {fmt_bytes(sent)} sent per direction per block and "
            f"microbatch ((cp-1)/cp of q {widths['q']}, k {widths['k']}, v {widths['v']}, out {widths['out']} "
            f"numbers per token); K/V held per layer: {fmt_bytes(cp_kv_bytes(lo, plan.args))} (all-gather: "
            f"{fmt_bytes(cp_kv_bytes(lo, plan.args, 'allgather'))}); synchronous, so fully exposed"
        )
    elif lo.cp > 1 and lo.cp_method == "hybrid":
        widths = cp_head_widths(lo, plan.args)
        local = lo.microbatch_size * lo.local_seq_len * lo.act_bytes
        a = lo.cp_a2a
        out.append(
            f"  cp (hybrid: all-to-all in groups of {a}, a ring over {lo.cp // a} groups): per block 4 all-to-alls "
            f"forward + 4 backward in the group ({fmt_bytes(sum(widths.values()) * local * (a - 1) // a)} sent per "
            f"direction), then the group's K and V ({fmt_bytes(local * widths['k'])} each) sent once per step the "
            f"block needs ({' or '.join(map(str, _ring_hops(plan)))} of {lo.cp // a - 1}) forward, K, V and dK, dV as "
            f"often backward; K/V held per "
            f"layer: {fmt_bytes(cp_kv_bytes(lo, plan.args))} (all-gather: "
            f"{fmt_bytes(cp_kv_bytes(lo, plan.args, 'allgather'))}); the all-to-alls exposed, the sends only beyond "
            f"the attention compute"
        )
    elif lo.cp > 1 and lo.cp_method == "ring":
        local = lo.microbatch_size * lo.local_seq_len * lo.act_bytes
        payload = ring_payload(plan.args, t)
        sizes = ", ".join(f"{what} {fmt_bytes(local * width)}" for what, width in payload.items())
        hops = _ring_hops(plan)
        out.append(
            f"  cp (ring): per block this rank's {' and '.join(payload)} ({sizes}) sent to the rank of each step the "
            f"block needs ({' or '.join(map(str, hops))} of {lo.cp - 1}: a sliding window within a chunk needs 2) "
            f"forward; backward as many again and their gradients straight home; K/V held per layer: "
            f"{fmt_bytes(cp_kv_bytes(lo, plan.args))} (all-gather: "
            f"{fmt_bytes(cp_kv_bytes(lo, plan.args, 'allgather'))}); each transfer overlaps the previous block's "
            f"attention: exposed only beyond the attention compute"
        )
    elif lo.cp > 1:
        kv = lo.seq_len * plan.args.n_kv_heads // t * plan.args.head_dim * lo.act_bytes * lo.microbatch_size
        out.append(
            f"  cp: per block 2 all-gathers (K, V) forward + 2 reduce-scatters backward of b S kv_dim/t a = "
            f"{fmt_bytes(kv)} each, {fmt_bytes(4 * kv * (lo.cp - 1) / lo.cp)} on the wire per block and "
            f"microbatch; synchronous inside attention, so fully exposed{_window_note(plan.args, lo, kv)}"
        )
    if lo.ep > 1:
        moe = _rank_moe(plan)
        if moe:
            m = next(iter(moe.values()))
            routed = lo.microbatch_size * lo.local_seq_len // (lo.tp if lo.ep_tp > 1 else 1)
            out.append(
                f"  ep: per MoE layer and microbatch this rank routes {routed:,} tokens x top-{m.top_k} = "
                f"{routed * m.top_k:,} rows; {lo.ep - 1}/{lo.ep} of them leave for the other ep ranks "
                f"(dispatch, then the combine brings them back), assuming the busiest rank gets "
                f"{lo.expert_imbalance:g} x the mean load; 3 all-to-alls forward (counts, dispatch, combine) + 2 "
                f"backward{' + 3 recomputed (full AC)' if any(lo.checkpointed(i) == 'full' for i in moe) else ''}; "
                f"synchronous, so fully exposed"
            )
    return out


def _step_notes(plan: Plan) -> list[str]:
    """Muon's step, and how the step time and MFU add up."""
    lo, c = plan.layout, plan.cost
    out = []
    hidden = (
        "reductions deferred past the last backward + what compute cannot hide"
        if lo.pp > 1
        else "what compute cannot hide"
    )
    cp = (" + cp" if lo.cp > 1 else "") + (" + ep" if lo.ep > 1 else "")
    muon = muon_rank(lo, plan.args, plan.rank)
    opt = ""
    if muon is not None:
        opt = " + optimizer"
        out.append(
            f"  optimizer: Muon orthogonalizes {muon.matrices} matrices on this rank (of its group of "
            f"{muon.group}), {_flops(muon.ns_flops)} of Newton-Schulz; sends {fmt_bytes(muon.sent * lo.ns_bytes)}, "
            f"receives {fmt_bytes(muon.received * lo.ns_bytes)} in {muon.collectives} all-to-alls; holds "
            f"{fmt_bytes(muon.largest_owned * lo.ns_bytes)} of owned full matrices per bucket; after the backward, "
            f"exposed (slowest rank): {fmt_seconds(c.optimizer)}"
        )
    out.append(
        f"  step = (compute + tp{cp}) x (1 + bubble) + pp + dp exposed ({hidden}){opt} = {fmt_seconds(c.step_time)}"
    )
    n = plan.cfg.training.sdc_check_interval
    if n:
        from titanlike.planner.sentinel import sdc_price

        sdc = sdc_price(plan.cfg, lo, plan.args, plan.rank)
        shown = ", ".join(f"{what}: {k} tensors" for what, k in sdc.groups)
        out.append(
            f"  sdc sentinel (every {n} steps and before each save): {fmt_bytes(sdc.bytes)} per check from this rank "
            f"({len(sdc.groups)} all-reduce(s) of fingerprints, {shown}; + 8 bytes over the job)"
        )
    out.append(
        f"  MFU {c.mfu:.1%}; {c.tokens_per_s:,.0f} tokens/s ({c.tokens_per_s_per_gpu:,.0f} per GPU); "
        f"model FLOPs {_flops(c.model_flops)} per step"
    )
    return out


_DIM_ORDER = (
    "tp",
    "cp",
    "cp_tp",
    "ep",
    "pp",
    "dp_shard",
    "dp_shard_cp",
    "dp_shard_mod_ep",
    "dp_shard_cp_tp",
    "dp_replicate",
    "dp_cp",  # an MoE model's expert loads and aux-loss terms, once per step
    "dp_cp_tp",
    "muon",
)


def _memory(plan: Plan) -> list[str]:
    hw = plan.hardware
    ranks = [plan.rank] + ([plan.peak_rank] if plan.peak_rank != plan.rank else [])
    out = ["", "== memory per rank (at the first backward: every in-flight microbatch's activations held)"]
    for r in ranks:
        lo = plan.layout
        stages = lo.stage_ids(lo.pp_rank_of(r))
        out.append(
            f"  rank {r} (pp rank {lo.pp_rank_of(r)}, stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}):"
        )
        for it in plan.memory[r]:
            out.append(f"    {it.name:<18}{fmt_bytes(it.bytes):>12}  {it.note}")
        total = plan.total_memory(r)
        verdict = "fits" if total <= hw.usable_memory else "DOES NOT FIT"
        out.append(
            f"    {'total':<18}{fmt_bytes(total):>12}  of {hw.memory_bytes / GiB:.1f} GiB "
            f"({hw.usable_memory / GiB:.1f} usable): {verdict}"
        )
    lo = plan.layout
    if lo.pp > 1:  # every pipeline rank's total: the stages it holds, their blocks (the split) and their memory
        per_pp, prefix = lo.world_size // lo.pp, get_spec(plan.cfg.model.name).block_container + "."
        totals = []
        for p in range(lo.pp):
            blocks = sum(sum(n.startswith(prefix) for n in lo.stages[s]) for s in lo.stage_ids(p))
            totals.append(f"{p}: {blocks} blocks {plan.total_memory(p * per_pp) / GiB:.1f}")
        out.append(f"  per pp rank (GiB): {', '.join(totals)}")
    tokens = lo.microbatch_size * lo.local_seq_len
    alts = []
    moe = _rank_moe(plan)
    layer, block = next(iter(moe.items()), (0, None))  # an MoE block's when the rank holds one
    for mode in ("none", "op", "full"):

        def size(sp: bool) -> str:
            layout = _replace_layout(lo, sequence_parallel=sp)
            return fmt_bytes(block_activation_bytes(layout, plan.args, tokens, mode, block, layer_id=layer))

        alts.append(f"AC {mode} {size(False)}" + (f" / SP {size(True)}" if lo.tp > 1 else ""))
    cp = f", cp {lo.cp}" if lo.cp > 1 else ""
    kind = "MoE block" if block is not None else "block"
    out.append(f"  one {kind}'s activations per microbatch of {tokens:,} tokens (tp {lo.tp}{cp}): " + ";  ".join(alts))
    return out


def _rank_moe(plan: Plan) -> dict:
    """Layer id -> MoEArgs of the MoE blocks on the stages of the plan's rank."""
    lo = plan.layout
    return {
        i: m for sid in lo.stage_ids(lo.pp_rank_of(plan.rank)) for i, m in moe_layers(plan.args, lo.stages[sid]).items()
    }


def _replace_layout(lo: Layout, **kw) -> Layout:
    from dataclasses import replace

    return replace(lo, **kw)


def _dry(plan: Plan) -> list[str]:
    d, lo = plan.dry, plan.layout
    out = [
        "",
        f"== dry run (titanlike.parallel.parallelize_model on a fake process group of {d.world_size:,} ranks, "
        f"meta device; rank {d.rank})",
    ]
    analytic = {(s, p.name): p for s, ps in rank_param_shards(lo, plan.args, d.rank).items() for p in ps}
    groups: dict[tuple, list] = defaultdict(list)
    for r in d.params:
        key = (r.stage, re.sub(r"layers\.\d+\.", "layers.*.", r.name), r.shape, r.local_shape, r.placements)
        groups[key].append(r)
    out.append(
        f"  {'stage':>5}  {'parameter':<34}{'x':>3}  {'global shape':<17}{'local shape':<15}{'bytes':>11}  "
        f"placements (mesh dims)"
    )
    for (stage, name, shape, local, placements), recs in groups.items():
        out.append(
            f"  {stage:>5}  {name:<34}{len(recs):>3}  {str(shape):<17}{str(local):<15}"
            f"{fmt_bytes(recs[0].nbytes):>11}  {placements}"
        )
    mismatches = [
        r.name
        for r in d.params
        if (r.stage, r.name) not in analytic or analytic[(r.stage, r.name)].local_shape != r.local_shape
    ]
    missing = len(analytic) - (len(d.params) - len(mismatches))
    total = sum(r.nbytes for r in d.params)
    out.append(
        f"  {len(d.params)} parameters, {fmt_bytes(total)} on this rank; analytic shard shapes: "
        + (
            "all equal"
            if not mismatches and not missing
            else f"{len(mismatches)} differ ({', '.join(mismatches[:3])}), {missing} missing"
        )
    )
    if d.block_activation_bytes is not None:
        cp = f" (cp {lo.cp}: this rank's share of {lo.seq_len}, with the gathered K/V)" if lo.cp > 1 else ""
        tokens = lo.microbatch_size * lo.local_seq_len
        moe = moe_layers(plan.args, lo.stages[lo.stage_ids(lo.pp_rank_of(d.rank))[0]])
        routing = ", experts balanced round-robin, without the ep dispatch" if d.probe_layer in moe else ""
        # the probe routes round-robin and cannot run the expert dispatch on fake tensors: compared without it
        analytic_act = block_activation_bytes(
            lo,
            plan.args,
            tokens,
            lo.checkpointed(d.probe_layer),
            moe.get(d.probe_layer),
            probe=True,
            layer_id=d.probe_layer,
        )
        same = (
            "equal"
            if analytic_act == d.block_activation_bytes
            else f"analytic {fmt_bytes(analytic_act)} ({analytic_act / max(d.block_activation_bytes, 1) - 1:+.1%})"
        )
        out.append(
            f"  activation probe: block layers.{d.probe_layer} under FakeTensorMode, {lo.microbatch_size} x "
            f"{lo.local_seq_len} tokens{cp}{routing}: {fmt_bytes(d.block_activation_bytes)} held after its forward; "
            f"{same}"
        )
    out.append(f"  took {d.seconds:.1f} s")
    return out


def render_plan(plan: Plan) -> str:
    lines = _header(plan) + _validation(plan)
    if plan.layout is not None:
        lines += _map(plan) + _price(plan) + _memory(plan)
        if plan.dry is not None:
            lines += _dry(plan)
    return "\n".join(lines)


def _ring_hops(plan) -> list[int]:
    """The ring's steps beyond a block's own, over the model's layers (a sliding-window layer needs fewer)."""
    return sorted({ring_hops(plan.layout, plan.args, i) for i in range(plan.args.n_layers)}, reverse=True)


def _window_note(args, lo, kv: float) -> str:
    """The cp line's sliding-window layers: their K / V gathers hold only the window's reach."""
    window_of = getattr(args, "window_of", None)
    if window_of is None:
        return ""
    windows = [window_of(i) for i in range(args.n_layers)]
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return ""
    tokens = cp_gathered_tokens(lo.seq_len, lo.cp, sliding[0])
    return (
        f"; the {len(sliding)} sliding-window layers (window {sliding[0]}) gather {tokens:,} of the {lo.seq_len:,} "
        f"positions ({fmt_bytes(kv * tokens / lo.seq_len)} each: bounded by the window)"
    )
