"""Every rule a configuration must satisfy on a world size, as data: one line (with the fix) per violation.

Pure arithmetic on the config tree and the model's shape: no process group, no model. ``config.validate`` raises
the first violation before anything starts; the planner reports them all. ``RULES`` names every rule; the test
``tests/layout/test_rules.py`` holds one bad configuration per name and checks that ``train.py`` refuses it with
exit code 2 and one line.
"""

from __future__ import annotations

import dataclasses

from titanlike.errors import ConfigError
from titanlike.layout.degrees import degree_problems, expert_degree_problem
from titanlike.layout.float8 import float8_violations
from titanlike.layout.muon import muon_violations
from titanlike.layout.policy import batch_split, canonical_microbatch_size, parse_ac_option, virtual_dp_degree
from titanlike.layout.schedules import SCHEDULES, schedule_facts
from titanlike.layout.sentinel import sdc_violations
from titanlike.layout.stages import parse_module_names, pipeline_stage_count, split_problem
from titanlike.models import get_spec
from titanlike.sharding import float8_patterns, muon_patterns

__all__ = [
    "OVERRIDE",
    "RULES",
    "layout_violations",
    "model_keys_read",
    "model_overrides",
    "resolve_local_batch",
    "rule_violations",
]

# The metadata mark of a [model] field that overrides the flavor's value (titanlike.config.Model declares them; its
# default means "the flavor's"). A model reads the overrides named like a field of its args dataclass.
OVERRIDE = "flavor_override"


def _override_fields(model_section) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(model_section) if f.metadata.get(OVERRIDE)]


def model_keys_read(spec, model_section) -> tuple[str, ...]:
    """The ``model.<key>`` overrides the model of ``spec`` reads: the schema's overrides (fields of the config's
    [model] section marked :data:`OVERRIDE`) that name a field of the model's args dataclass, in schema order."""
    args_fields = {f.name for f in dataclasses.fields(spec.args_cls)}
    return tuple(f.name for f in _override_fields(model_section) if f.name in args_fields)


def model_overrides(model_section) -> dict[str, object]:
    """The ``model.<key>`` overrides set (not at their default, the flavor's), key -> value, in schema order."""
    return {
        f.name: getattr(model_section, f.name)
        for f in _override_fields(model_section)
        if getattr(model_section, f.name) != f.default
    }


# rule name -> what it guards (the messages themselves name the keys and the fix)
RULES = {
    "dim_heads": "model.dim divisible by n_heads",
    "heads_kv": "n_heads divisible by n_kv_heads",
    "model_keys": "every model.<key> override set is one the model (model.name's spec) reads",
    "model_shape": "the model's own shape rules (ModelSpec.shape_violations; Llama: head_dim even for RoPE, "
    "RoPE scaling factor >= 1, low < high frequency factor, original length >= 1)",
    "seq_len_max": "training.seq_len <= the model's max_seq_len",
    "degrees": "the degrees multiply to the world size (dp_shard -1 infers)",
    "cp_seq_len": "seq_len divisible by 2 x cp (two load-balanced chunks per cp rank)",
    "cp_sp_seq_len": "a cp rank's tokens divisible by tp under sequence parallelism",
    "mask_reset": "model.reset_position_ids needs model.attn_mask_type = block_causal",
    "mask_model": "model.attn_mask_type = block_causal on models that declare it (ModelSpec.block_causal: the mask "
    "through the attention seam)",
    "cp_kernels": "context parallelism with model.kernels=torch",
    "cp_method_needs_cp": "parallelism.context_parallel_method other than allgather needs context_parallel_degree > 1",
    "cp_heads": "context_parallel_method alltoall: cp divides the query heads of a tp rank (kv heads cp does not "
    "divide are repeated); hybrid: context_parallel_a2a_degree divides them",
    "cp_a2a_degree": "parallelism.context_parallel_a2a_degree only with context_parallel_method hybrid, and there "
    "strictly between 1 and cp, dividing cp",
    "cp_float8": "context parallelism without float8",
    "cp_model": "context parallelism on models that declare it (ModelSpec.context_parallel: the shared attention and "
    "position seams)",
    "te_model": "Transformer Engine kernels on models that declare a TE-swappable norm (ModelSpec.te_norm)",
    "float8_model": "float8 training on models whose sharding marks float8-eligible Linears (float8=True entries)",
    "tp_plan": "tensor parallelism on a model whose sharding, derived from its args, exists (ModelSpec.sharding_fn: "
    "a transformers model's base_model_tp_plan translated exactly)",
    "tp_heads": "tp divides n_heads",
    "tp_kv_heads": "tp divides n_kv_heads",
    "tp_ffn": "tp divides the ffn hidden size",
    "tp_model": "the model's own tensor-parallel rules (ModelSpec.tp_violations; Qwen3-Next: tp divides the "
    "linear-attention key heads)",
    "tp_vocab": "tp divides the padded vocabulary",
    "sp_seq_len": "tp divides seq_len under sequence parallelism",
    "sp_needs_tp": "sequence parallelism needs tp > 1",
    "te_tp": "Transformer Engine kernels with tp 1 (TE modules are not nn.Linear: the TP plan cannot apply)",
    "batch": "global batch divisible by local batch x dp",
    "pp_names_need_pp": "pipeline_parallel_module_names needs pp > 1",
    "ac_option": "selective_ac_option 'op' or a positive integer",
    "float8": "the [float8] options agree (recipe vs backend vs model.kernels, not float64, all-gather options)",
    "muon": "the Muon options agree (Muon-only [optimizer] keys need optimizer.name = Muon, 3 Newton-Schulz "
    "coefficients, a model whose sharding entries mark matrices for Muon)",
    "pp_stages_divide": "the stages divide over the pp ranks",
    "pp_single_stage": "GPipe / 1F1B run one stage per rank",
    "pp_v_two_stages": "V-placement schedules run exactly two stages per rank",
    "pp_multi_stage": "interleaved schedules run at least two stages per rank",
    "pp_module_names": "pipeline_parallel_module_names lists every module once, in order",
    "pp_layers_per_stage": "layers_per_stage and stages_per_rank, both set, give the same number of stages",
    "pp_empty_stage": "no stage is empty (at most as many stages as layers, the embedding / head weights included)",
    "pp_end_weights": "the embedding / head weights (first/last_stage_less_layers) fit in a stage's share",
    "pp_microbatch_size": "microbatch size divides local_batch_size",
    "pp_microbatches": "at least pp microbatches unless breadth-first, one per stage where torch needs it, whole "
    "rounds of pp where torch runs rounds (ScheduleFacts)",
    "zb_reshard": "split-backward schedules with fsdp_reshard_after_forward != always",
    "zb_op_ac": "split-backward schedules without op-level selective AC",
    "zb_compile": "split-backward schedules without compiled blocks",
    "zb_latent_ring": "split-backward schedules without the ring method on multi-head latent attention (its "
    "up-projection's weight gradients are computed in the input-gradient pass)",
    "ep_degree": "expert_parallel_degree divides dp_shard x cp (the ranks it borrows)",
    "ep_model": "expert parallelism on models with experts (ModelSpec.num_experts)",
    "ep_experts": "expert_parallel_degree divides the number of experts",
    "ep_dispatch": "parallelism.expert_dispatch padded on models with experts (ModelSpec.num_experts)",
    "moe_tp": "a model with experts under tp > 1 only with sequence parallelism and ep > 1 (ep borrows the tp ranks)",
    "mtp_layout": "training.mtp_loss_weight >= 0 (the multi-token-prediction depths' weight), set only for a model "
    "with MTP depths, and a sequence longer than the depths (depth k's targets are k tokens further ahead)",
    "sdc": "training.sdc_check_interval a positive integer (0: off), on a layout holding some state twice (HSDP "
    "replicas, tp-replicated norms, a weight tied across pipeline stages, torchft replica groups): else nothing to "
    "compare",
    "invariant_virtual_dp": "training.layout_invariant: virtual_dp_degree a power of two that the data-parallel degree "
    "divides (set only with layout_invariant)",
    "invariant_batch": "training.layout_invariant: the global batch cut into virtual_dp_degree x canonical "
    "microbatches of local_batch_size",
    "invariant_layout": "training.layout_invariant on the layouts and features shown invariant (one process, FSDP, "
    "HSDP, pp with every schedule, alone or x FSDP; no tp / cp / ep, embeddings tied across stages, experts, MTP, "
    "Muon, torchft, float8, compile, AC or TE kernels yet)",
    "cpu_offload": "training.enable_cpu_offload on a layout FSDP wraps (dp_shard x cp or dp_replicate > 1), without "
    "pipeline parallelism, experts, float8 or layout_invariant",
    "zero1": "parallelism.distributed_optimizer on replicated data parallelism only (data_parallel_replicate_degree > "
    "1, shard degree 1, no tp / cp / pp / experts), with AdamW (foreach or for-loop), without CPU offload",
    "act_offload": "activation_checkpoint.offload without tensor parallelism (its saved tensors are DTensors) or "
    "compile (dynamo does not trace its saved-tensor hooks)",
    "export_model": "checkpoint.export_safetensors on models with a Hugging Face adapter that can express them "
    "(ModelSpec.hf_adapter, hf_export_violations: Qwen3-MoE's expert bias)",
}


def layout_violations(cfg, world_size: int, args) -> list[str]:
    """Every violated rule of ``cfg`` on ``world_size`` ranks with model shape ``args``, one line each."""
    return [message for _, message in rule_violations(cfg, world_size, args)]


def _mtp_violations(cfg, args) -> list[str]:
    """Multi-token prediction: a weight >= 0, not set for a model without MTP depths (it would be ignored), and
    every depth with targets inside the sequence (depth ``D`` of a ``seq_len`` window has ``seq_len - D`` of them).
    The depths sit on the last pipeline stage, which gets the token ids; context parallelism gathers them (the
    window seam), so any layout holds them."""
    weight, depths = cfg.training.mtp_loss_weight, getattr(args, "mtp_layers", 0) or 0
    default = next(f.default for f in dataclasses.fields(cfg.training) if f.name == "mtp_loss_weight")
    out = []
    if not weight >= 0:
        out.append(f"training.mtp_loss_weight {weight} must be >= 0")
    elif not depths and weight != default:
        out.append(
            f"training.mtp_loss_weight {weight}: {cfg.model.name} has no multi-token-prediction depths "
            f"(model.mtp_layers), so nothing reads it; remove it"
        )
    if depths and cfg.training.seq_len <= depths:
        out.append(
            f"model.mtp_layers {depths} needs training.seq_len > {depths} (depth {depths} predicts {depths} tokens "
            f"further ahead: no target left in a sequence of {cfg.training.seq_len}); lower model.mtp_layers or raise "
            f"training.seq_len"
        )
    return out


def rule_violations(cfg, world_size: int, args) -> list[tuple[str, str]]:
    """:func:`layout_violations` with the name (a key of :data:`RULES`) of the rule each line comes from."""
    p, t = cfg.parallelism, cfg.training
    spec = get_spec(cfg.model.name)
    out = _model_violations(cfg, spec, args)
    # Degrees.
    tp, pp, cp = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree
    problems, dps = degree_problems(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=cp,
        tp=tp,
        pp=pp,
        world_size=world_size,
    )
    out += [("degrees", m) for m in problems]
    if not problems:
        out += _expert_violations(cfg, spec, args, dps, cp, tp)
    if cp > 1:
        out += _context_parallel_violations(cfg, cp, tp, args)
    elif p.context_parallel_method != "allgather":
        out.append(
            (
                "cp_method_needs_cp",
                f"parallelism.context_parallel_method {p.context_parallel_method} needs context_parallel_degree > 1 "
                f"(cp 1 splits no sequence); remove it or raise the cp degree",
            )
        )
    out += [("cp_a2a_degree", m) for m in _a2a_degree_problems(p, cp)]
    out += [("mtp_layout", m) for m in _mtp_violations(cfg, args)]
    out += [("sdc", m) for m in sdc_violations(cfg, args)]
    if not problems:
        out += _offload_violations(cfg, spec, args, p.data_parallel_replicate_degree * dps * cp, tp, pp)
    dp = p.data_parallel_replicate_degree * dps
    if tp > 1:
        out += _tensor_parallel_violations(cfg, args, tp)
        out += [("tp_model", m) for m in spec.tp_violations(args, tp)]
    elif p.enable_sequence_parallel:
        out.append(
            (
                "sp_needs_tp",
                "parallelism.enable_sequence_parallel needs tensor_parallel_degree > 1; turn it off or raise the tp "
                "degree",
            )
        )
    # Batch.
    split = batch_split(t.global_batch_size, t.local_batch_size, dp, virtual_dp_degree(t))
    if split.problem:
        out.append(("batch", split.problem))
    out += _invariant_violations(cfg, spec, args, dp, split)
    # Pipeline.
    if pp > 1:
        out += _pipeline_violations(_with_local_batch(cfg, split), args, pp)
    elif p.pipeline_parallel_module_names:
        out.append(
            ("pp_names_need_pp", "parallelism.pipeline_parallel_module_names needs pipeline_parallel_degree > 1")
        )
    return out + _feature_violations(cfg, spec, args, tp, cp)


def _with_local_batch(cfg, split):
    """``cfg`` with ``training.local_batch_size`` = -1 replaced by the split's local batch (the rules that read it)."""
    if cfg.training.local_batch_size != -1 or split.problem:
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, local_batch_size=split.local_batch))


def resolve_local_batch(cfg, world_size: int) -> None:
    """``training.local_batch_size = -1``: set it to ``training.global_batch_size`` over the data-parallel degree of
    this world size, so that every reader sees the per-rank batch. Left at -1 when the degrees or the split are
    refused (:func:`layout_violations` says why)."""
    p, t = cfg.parallelism, cfg.training
    if t.local_batch_size != -1:
        return
    problems, dps = degree_problems(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
    )
    split = batch_split(t.global_batch_size, -1, p.data_parallel_replicate_degree * dps, virtual_dp_degree(t))
    if not problems and not split.problem:
        t.local_batch_size = split.local_batch


def _invariant_violations(cfg, spec, args, dp: int, split) -> list[tuple[str, str]]:
    """``training.layout_invariant``: V a power of two that dp divides, the batch in whole canonical microbatches, and
    only what is shown invariant (docs/layout_invariance.md); one line per problem, each naming what works."""
    t, p = cfg.training, cfg.parallelism
    v = t.virtual_dp_degree
    default_v = next(f.default for f in dataclasses.fields(t) if f.name == "virtual_dp_degree")
    if not t.layout_invariant:
        if v != default_v:
            return [
                (
                    "invariant_virtual_dp",
                    f"training.virtual_dp_degree {v} is read only by a layout-invariant run; set "
                    f"training.layout_invariant = true or remove it",
                )
            ]
        return []
    out = []
    if v < 1 or v & (v - 1):
        out.append(
            ("invariant_virtual_dp", f"training.virtual_dp_degree {v} must be a power of two (1, 2, 4, 8, 16, ...)")
        )
    elif v % dp:
        out.append(
            (
                "invariant_virtual_dp",
                f"training.layout_invariant: the data-parallel degree {dp} does not divide training.virtual_dp_degree "
                f"{v}; use a power-of-two dp up to {v}, or raise virtual_dp_degree to a power of two >= {dp}",
            )
        )
    elif not split.problem and split.global_batch % (v * canonical_microbatch_size(cfg)):
        c = canonical_microbatch_size(cfg)
        what = "pipeline_parallel_microbatch_size" if p.pipeline_parallel_degree > 1 else "local_batch_size"
        out.append(
            (
                "invariant_batch",
                f"training.layout_invariant: global batch {split.global_batch} does not split into "
                f"virtual_dp_degree {v} x canonical microbatches of {what} {c}; use a multiple of {v * c}",
            )
        )
    pp = p.pipeline_parallel_degree > 1
    not_yet = [
        (p.tensor_parallel_degree > 1, "tensor parallelism"),
        (p.context_parallel_degree > 1, "context parallelism"),
        (pp and bool(getattr(args, "tie_embeddings", False)), "embeddings tied across pipeline stages"),
        (p.expert_parallel_degree > 1, "expert parallelism"),
        (spec.num_experts(args) > 0, f"a model with experts ({cfg.model.name}: load counts and the aux loss)"),
        ((getattr(args, "mtp_layers", 0) or 0) > 0, "multi-token prediction depths"),
        (cfg.optimizer.name == "Muon", "Muon"),
        (cfg.fault_tolerance.enable, "torchft replica groups"),
        (bool(cfg.float8.recipe), "float8"),
        (cfg.compile.enable, "torch.compile"),
        (cfg.activation_checkpoint.mode != "none", "activation checkpointing"),
        (cfg.model.kernels != "torch", f"model.kernels={cfg.model.kernels}"),
    ]
    named = [what for bad, what in not_yet if bad]
    if named:
        out.append(
            (
                "invariant_layout",
                f"training.layout_invariant: not invariant yet with {', '.join(named)}; it works on one process, "
                f"FSDP, HSDP and pipeline parallelism (every schedule), alone or x FSDP (AdamW, clipping, "
                f"float32 / bfloat16 / float64, models without experts or MTP): turn those off or "
                f"training.layout_invariant off",
            )
        )
    return out


def _model_violations(cfg, spec, args) -> list[tuple[str, str]]:
    """The [model] section's keys and masks, and the model's shape (its own rules, its maximum sequence length)."""
    out: list[tuple[str, str]] = []

    def add(rule: str, message: str) -> None:
        out.append((rule, message))

    reads = model_keys_read(spec, cfg.model)
    unread = [k for k in model_overrides(cfg.model) if k not in reads]
    if unread:
        add(
            "model_keys",
            f"model.{unread[0]}: {spec.name} has no such setting (it reads "
            f"{', '.join('model.' + k for k in reads)}); remove "
            f"{', '.join('model.' + k for k in unread)}",
        )
    if cfg.model.attn_mask_type == "block_causal" and not spec.block_causal:
        add(
            "mask_model",
            f"model.attn_mask_type = 'block_causal': {spec.name} does not pass the document mask to its attention "
            f"(ModelSpec.block_causal); use model.attn_mask_type = 'causal' for {spec.name}",
        )
    if cfg.model.reset_position_ids and cfg.model.attn_mask_type != "block_causal":
        add(
            "mask_reset",
            "model.reset_position_ids: positions restart at document starts, which only the block-causal mask "
            "knows; set model.attn_mask_type = 'block_causal' or drop it",
        )
    if args.dim % args.n_heads:
        add(
            "dim_heads",
            f"model: dim {args.dim} is not divisible by n_heads {args.n_heads}; choose n_heads dividing dim",
        )
    if args.n_heads % args.n_kv_heads:
        add(
            "heads_kv",
            f"model: n_heads {args.n_heads} is not divisible by n_kv_heads {args.n_kv_heads}; "
            f"choose n_kv_heads dividing n_heads",
        )
    out += [("model_shape", m) for m in spec.shape_violations(args)]
    seq_len = cfg.training.seq_len
    if seq_len > args.max_seq_len:
        add(
            "seq_len_max",
            f"training.seq_len {seq_len} exceeds the model's max_seq_len {args.max_seq_len}; "
            f"lower training.seq_len or raise model.max_seq_len",
        )
    return out


def _tensor_parallel_violations(cfg, args, tp: int) -> list[tuple[str, str]]:
    """tp > 1: tp divides the heads, the ffn and the vocabulary (and seq_len under sequence parallelism)."""
    out: list[tuple[str, str]] = []

    def add(rule: str, message: str) -> None:
        out.append((rule, message))

    if args.n_heads % tp:
        add(
            "tp_heads",
            f"parallelism.tensor_parallel_degree {tp} does not divide n_heads {args.n_heads}; "
            f"choose a tp degree dividing {args.n_heads}",
        )
    if args.n_kv_heads % tp and args.n_kv_heads != args.n_heads:
        add(
            "tp_kv_heads",
            f"parallelism.tensor_parallel_degree {tp} does not divide n_kv_heads {args.n_kv_heads}; "
            f"choose a tp degree dividing {args.n_kv_heads}",
        )
    if args.hidden_dim % tp:
        add(
            "tp_ffn",
            f"parallelism.tensor_parallel_degree {tp} does not divide the ffn hidden size {args.hidden_dim}",
        )
    if args.vocab_size > 0 and args.vocab_size % tp:
        add(
            "tp_vocab",
            f"parallelism.tensor_parallel_degree {tp} does not divide the vocabulary {args.vocab_size}; "
            f"set model.vocab_multiple to a multiple of {tp}",
        )
    seq_len = cfg.training.seq_len
    if cfg.parallelism.enable_sequence_parallel and seq_len % tp:
        add(
            "sp_seq_len",
            f"training.seq_len {seq_len} is not divisible by tensor_parallel_degree {tp} under "
            f"sequence parallelism; choose a multiple of {tp}",
        )
    if cfg.model.kernels == "te":
        add(
            "te_tp",
            f"model.kernels=te does not combine with tensor_parallel_degree {tp} (TE modules are not "
            f"nn.Linear, so the TP plan cannot shard them); use model.kernels=torch or tp 1",
        )
    return out


def _zero1_violations(cfg, spec, args, fsdp_ranks: int, tp: int, pp: int) -> list[tuple[str, str]]:
    """ZeRO-1 (parallelism.distributed_optimizer): where it is wired and checked."""
    p, key = cfg.parallelism, "parallelism.distributed_optimizer"
    rep = p.data_parallel_replicate_degree
    if rep < 2 or fsdp_ranks != rep:
        why = f"data_parallel_replicate_degree {rep}" + ("" if rep > 1 else " (nothing to shard the state over)")
        return [
            (
                "zero1",
                f"{key} shards AdamW's state over replicated data-parallel ranks, and this layout has "
                f"{why} with shard x cp degree {fsdp_ranks // max(rep, 1)}; set data_parallel_replicate_degree to "
                f"the dp degree and data_parallel_shard_degree 1 (or use FSDP: {key} false)",
            )
        ]
    other = [
        (tp > 1, "tensor parallelism"),
        (pp > 1, "pipeline parallelism"),
        (bool(spec.num_experts(args)), "a model with experts"),
        (cfg.optimizer.name != "AdamW", f"optimizer.name {cfg.optimizer.name}"),
        (cfg.optimizer.implementation == "fused", "optimizer.implementation fused"),
        (cfg.training.enable_cpu_offload, "training.enable_cpu_offload"),
        (cfg.training.layout_invariant, "training.layout_invariant"),
    ]
    return [("zero1", f"{key} is not wired with {what} yet; turn it off") for bad, what in other if bad][:1]


def _offload_violations(cfg, spec, args, fsdp_ranks: int, tp: int, pp: int) -> list[tuple[str, str]]:
    """CPU offload (FSDP2's CPUOffloadPolicy) and activation offload: where they are wired and checked."""
    out = []
    if cfg.training.enable_cpu_offload:
        fix = "turn training.enable_cpu_offload off"
        if fsdp_ranks < 2:
            out.append(
                (
                    "cpu_offload",
                    f"training.enable_cpu_offload offloads FSDP's shards, and this layout has no "
                    f"FSDP (data-parallel degree 1); raise data_parallel_shard_degree or {fix}",
                )
            )
        elif pp > 1 or spec.num_experts(args) or cfg.float8.recipe or cfg.training.layout_invariant:
            what = (
                "pipeline parallelism"
                if pp > 1
                else "a model with experts"
                if spec.num_experts(args)
                else ("float8" if cfg.float8.recipe else "training.layout_invariant")
            )
            out.append(("cpu_offload", f"training.enable_cpu_offload is not wired with {what} yet; {fix}"))
    if cfg.parallelism.distributed_optimizer:
        out += _zero1_violations(cfg, spec, args, fsdp_ranks, tp, pp)
    if cfg.activation_checkpoint.offload and tp > 1:
        out.append(
            (
                "act_offload",
                "activation_checkpoint.offload does not offload the DTensors tensor parallelism "
                "saves; set tensor_parallel_degree 1 or turn activation_checkpoint.offload off",
            )
        )
    if cfg.activation_checkpoint.offload and cfg.compile.enable:
        out.append(
            (
                "act_offload",
                "activation_checkpoint.offload cannot run inside compiled blocks (dynamo does not trace its "
                "saved-tensor hooks, torch 2.13); turn compile.enable or activation_checkpoint.offload off",
            )
        )
    return out


def _feature_violations(cfg, spec, args, tp: int, cp: int) -> list[tuple[str, str]]:
    """The features a model must declare (TE, float8, cp, a TP plan, export) and the option groups' own rules."""
    out: list[tuple[str, str]] = []

    def add(rule: str, message: str) -> None:
        out.append((rule, message))

    if cfg.activation_checkpoint.mode == "selective":
        try:
            parse_ac_option(cfg.activation_checkpoint.selective_ac_option)
        except ConfigError as e:
            add("ac_option", str(e))
    if cfg.model.kernels == "te" and spec.te_norm is None:
        add(
            "te_model",
            f"model.kernels=te swaps Transformer Engine modules only into models that declare them "
            f"(ModelSpec.te_norm), and {spec.name} declares none; use model.kernels=torch for {spec.name}",
        )
    try:
        entries = spec.sharding_of(args)
    except ValueError as e:  # a model whose sharding is derived from its args and cannot be (ModelSpec.sharding_fn)
        entries = {}
        if tp > 1:
            add("tp_plan", f"parallelism.tensor_parallel_degree {tp}: {spec.name}: {e}")
    if cfg.float8.recipe and not float8_patterns(entries):
        add(
            "float8_model",
            f"float8.recipe={cfg.float8.recipe}: {spec.name} marks no Linear float8-eligible (its sharding "
            f"entries); leave float8.recipe empty for {spec.name}",
        )
    if cp > 1 and not spec.context_parallel:
        add(
            "cp_model",
            f"parallelism.context_parallel_degree {cp}: {spec.name} does not declare context parallelism "
            f"(ModelSpec.context_parallel: attention and positions through the shared seams); set cp 1 for "
            f"{spec.name}",
        )
    if cfg.checkpoint.export_safetensors and not spec.hf_adapter:
        add(
            "export_model",
            f"checkpoint.export_safetensors writes a Hugging Face checkpoint, and {spec.name} has no Hugging Face "
            f"adapter (ModelSpec.hf_adapter); turn it off (the step checkpoints keep the weights)",
        )
    elif cfg.checkpoint.export_safetensors:
        out += [("export_model", m) for m in spec.hf_export_violations(args)]
    out += [("float8", m) for m in float8_violations(cfg)]
    out += [("muon", m) for m in muon_violations(cfg, muon_patterns(entries), spec.name)]
    return out


def _expert_violations(cfg, spec, args, dp_shard: int, cp: int, tp: int) -> list[tuple[str, str]]:
    ep, experts = cfg.parallelism.expert_parallel_degree, spec.num_experts(args)
    out: list[tuple[str, str]] = []
    problem = expert_degree_problem(ep, dp_shard, cp, tp if ep > 1 else 1)
    if problem:
        out.append(("ep_degree", problem))
    if ep > 1 and not experts:
        out.append(
            (
                "ep_model",
                f"parallelism.expert_parallel_degree {ep}: {spec.name} has no experts (ModelSpec.num_experts); set "
                f"expert_parallel_degree 1 or use a model with experts (qwen3_moe)",
            )
        )
    elif ep > 1 and experts % ep:
        out.append(
            (
                "ep_experts",
                f"parallelism.expert_parallel_degree {ep} does not divide the {experts} experts of {spec.name}; "
                f"choose a divisor of {experts}",
            )
        )
    if cfg.parallelism.expert_dispatch != "uneven" and not experts:
        out.append(
            (
                "ep_dispatch",
                f"parallelism.expert_dispatch {cfg.parallelism.expert_dispatch}: {spec.name} has no experts to "
                f"dispatch to; set expert_dispatch uneven or use a model with experts (qwen3_moe)",
            )
        )
    if experts and tp > 1 and (ep == 1 or not cfg.parallelism.enable_sequence_parallel):
        out.append(
            (
                "moe_tp",
                f"parallelism.tensor_parallel_degree {tp}: {spec.name} has experts, which split over ep, not tp: its "
                f"MoE blocks route each tp rank's own tokens, so set parallelism.enable_sequence_parallel = true and "
                f"expert_parallel_degree > 1 (it borrows the tp ranks), or use tp 1",
            )
        )
    return out


def _a2a_degree_problems(p, cp: int) -> list[str]:
    """``context_parallel_a2a_degree``: read by the hybrid method only, which needs a group size strictly between
    1 (the ring method) and cp (the alltoall method) that divides cp."""
    a2a = p.context_parallel_a2a_degree
    if p.context_parallel_method != "hybrid":
        if a2a == 1:
            return []
        return [
            f"parallelism.context_parallel_a2a_degree {a2a} is read by context_parallel_method hybrid only (method "
            f"{p.context_parallel_method}); remove it or set context_parallel_method hybrid"
        ]
    if a2a == 1 or a2a == cp:
        method = "ring" if a2a == 1 else "alltoall"
        return [
            f"parallelism.context_parallel_method hybrid with context_parallel_a2a_degree {a2a} (cp {cp}) is the "
            f"{method} method; set context_parallel_method {method}, or an a2a degree strictly between 1 and cp"
        ]
    if a2a < 1 or cp % a2a:
        return [
            f"parallelism.context_parallel_a2a_degree {a2a} does not divide context_parallel_degree {cp} (groups of "
            f"a2a cp ranks, a ring across cp / a2a of them); choose a divisor of {cp} between 2 and {cp // 2}"
        ]
    return []


def _context_parallel_violations(cfg, cp: int, tp: int, args) -> list[tuple[str, str]]:
    p, t = cfg.parallelism, cfg.training
    out: list[tuple[str, str]] = []
    heads = getattr(args, "n_heads", None)
    split = {"alltoall": cp, "hybrid": p.context_parallel_a2a_degree}.get(p.context_parallel_method, 0)
    if split > 1 and heads and heads % tp == 0 and (heads // tp) % split:
        degree = "context_parallel_degree" if p.context_parallel_method == "alltoall" else "context_parallel_a2a_degree"
        out.append(
            (
                "cp_heads",
                f"parallelism.context_parallel_method {p.context_parallel_method}: the {heads // tp} query heads of a "
                f"tp rank (n_heads {heads} / tp {tp}) are not divisible by {degree} {split} (the all-to-all "
                f"hands each rank of its group heads / {split} of them); use context_parallel_method allgather or "
                f"ring, or a {degree} that divides {heads // tp}",
            )
        )
    if t.seq_len % (2 * cp):
        out.append(
            (
                "cp_seq_len",
                f"training.seq_len {t.seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp} (each "
                f"cp rank holds 2 of {2 * cp} load-balanced chunks); choose a multiple of {2 * cp}",
            )
        )
    elif p.enable_sequence_parallel and tp > 1 and (t.seq_len // cp) % tp:
        out.append(
            (
                "cp_sp_seq_len",
                f"training.seq_len {t.seq_len}: the {t.seq_len // cp} tokens of a cp rank are not divisible by "
                f"tensor_parallel_degree {tp} under sequence parallelism; choose a multiple of {cp * tp} and "
                f"{2 * cp}",
            )
        )
    if cfg.model.kernels != "torch":
        out.append(
            (
                "cp_kernels",
                f"parallelism.context_parallel_degree {cp}: model.kernels={cfg.model.kernels} has no "
                f"context-parallel path (proven only with the torch kernels); set model.kernels=torch or cp 1",
            )
        )
    if cfg.float8.recipe:
        out.append(
            (
                "cp_float8",
                f"float8.recipe={cfg.float8.recipe} with context_parallel_degree {cp}: float8 training is not "
                f"proven under context parallelism; leave float8.recipe empty or set cp 1",
            )
        )
    return out


def _schedules(having) -> str:
    """The schedules whose facts satisfy ``having``, for a message ("GPipe / 1F1B")."""
    return " / ".join(n for n in SCHEDULES if having(schedule_facts(n)))


def _pipeline_violations(cfg, args, pp: int) -> list[tuple[str, str]]:
    n_stages = pipeline_stage_count(cfg, args)
    return (
        _stage_count_violations(cfg, n_stages, pp)
        + _layer_split_violations(cfg, args, n_stages)
        + _microbatch_violations(cfg, n_stages, pp)
        + _split_backward_violations(cfg, args)
    )


def _stage_count_violations(cfg, n_stages: int, pp: int) -> list[tuple[str, str]]:
    """The stages divide over the pp ranks, as many per rank as the schedule runs."""
    out: list[tuple[str, str]] = []

    def add(rule: str, message: str) -> None:
        out.append((rule, message))

    sched = cfg.parallelism.pipeline_parallel_schedule
    facts = schedule_facts(sched)
    if n_stages % pp:
        add(
            "pp_stages_divide",
            f"pipeline: {n_stages} stages do not divide evenly over pp {pp} ranks; adjust "
            f"pipeline_parallel_layers_per_stage or pipeline_parallel_stages_per_rank",
        )
    v = n_stages // pp if n_stages % pp == 0 else 1
    if facts.single_stage and v != 1:
        add(
            "pp_single_stage",
            f"parallelism.pipeline_parallel_schedule {sched} runs one stage per rank but the split gives "
            f"{v}; use {_schedules(lambda f: not f.single_stage and not f.v_placement)} or fewer stages",
        )
    if facts.v_placement and v != 2:
        add(
            "pp_v_two_stages",
            f"parallelism.pipeline_parallel_schedule {sched} needs exactly 2 stages per rank (V shape), got {v}",
        )
    if not facts.single_stage and not facts.v_placement and v < 2:
        add(
            "pp_multi_stage",
            f"parallelism.pipeline_parallel_schedule {sched} needs at least 2 stages per rank; use "
            f"{_schedules(lambda f: f.single_stage)} or set pipeline_parallel_stages_per_rank >= 2",
        )
    return out


def _layer_split_violations(cfg, args, n_stages: int) -> list[tuple[str, str]]:
    """The layers go into the stages: the module names listed per stage, or torchtitan's split (uneven allowed, the
    first stages one block more) with no stage empty."""
    p = cfg.parallelism
    first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    eff = args.n_layers + first + last
    lps = p.pipeline_parallel_layers_per_stage
    if p.pipeline_parallel_module_names:
        try:
            parse_module_names(p.pipeline_parallel_module_names, args.n_layers, spec=get_spec(cfg.model.name))
        except ConfigError as e:
            return [("pp_module_names", str(e))]
        return []
    if lps and p.pipeline_parallel_stages_per_rank and -(-eff // lps) != n_stages:
        fits = [k for k in range(1, eff + 1) if -(-eff // k) == n_stages]
        fix = f"layers_per_stage {fits[0]} makes {n_stages}" if fits else "drop layers_per_stage"
        return [
            (
                "pp_layers_per_stage",
                f"parallelism.pipeline_parallel_layers_per_stage {lps} makes {-(-eff // lps)} stages of "
                f"{args.n_layers} layers (+{first} for the embedding, +{last} for the head), "
                f"pipeline_parallel_stages_per_rank {p.pipeline_parallel_stages_per_rank} makes {n_stages}; set one "
                f"of them ({fix})",
            )
        ]
    problem = split_problem(args.n_layers, n_stages, first, last)
    if problem is None:
        return []
    return [("pp_empty_stage" if eff < n_stages else "pp_end_weights", problem)]


def _microbatch_violations(cfg, n_stages: int, pp: int) -> list[tuple[str, str]]:
    """The microbatch size divides the local batch into as many microbatches as the schedule needs."""
    t, sched = cfg.training, cfg.parallelism.pipeline_parallel_schedule
    facts = schedule_facts(sched)
    mbs = cfg.parallelism.pipeline_parallel_microbatch_size
    if t.local_batch_size % mbs:
        return [
            (
                "pp_microbatch_size",
                f"training.local_batch_size {t.local_batch_size} is not divisible by "
                f"pipeline_parallel_microbatch_size {mbs}",
            )
        ]
    m = t.local_batch_size // mbs
    # A schedule that alternates forwards and backwards warms up with pp microbatches in flight: proven with
    # at least pp (torch accepts fewer for some); breadth-first ones run any number (the pipeline gate has m=1).
    if not facts.breadth_first and m < pp:
        message = (
            f"pipeline: {m} microbatches (local_batch_size / pipeline_parallel_microbatch_size) are fewer "
            f"than pp {pp} stages for {sched}; raise local_batch_size to at least {pp * mbs}"
        )
    elif facts.microbatch_per_stage and m < n_stages:
        message = (
            f"pipeline: {sched} needs at least as many microbatches as stages ({n_stages}), got {m}; "
            f"raise local_batch_size to at least {n_stages * mbs}"
        )
    elif facts.microbatch_rounds and m % max(1, m // pp):
        message = (
            f"pipeline: {sched} runs the {m} microbatches in rounds of pp={pp} and needs m divisible by "
            f"m // pp = {m // pp}; use a multiple of {pp} microbatches"
        )
    else:
        return []
    return [("pp_microbatches", message)]


def _split_backward_violations(cfg, args) -> list[tuple[str, str]]:
    """Split-backward (zero-bubble) schedules run each backward as an input-gradient and a later weight-gradient
    pass over the same graph (retain_graph); these features assume one backward per forward."""
    p = cfg.parallelism
    sched = p.pipeline_parallel_schedule
    if not schedule_facts(sched).split_backward:
        return []
    out: list[tuple[str, str]] = []
    if p.fsdp_reshard_after_forward == "always":
        out.append(
            (
                "zb_reshard",
                f"parallelism.fsdp_reshard_after_forward 'always' gives wrong gradients with {sched} (its "
                f"weight-gradient passes run outside FSDP's hooks); use 'default' or 'never'",
            )
        )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        out.append(
            (
                "zb_op_ac",
                f"activation_checkpoint: op-level selective checkpointing allows one backward per region, "
                f"{sched} runs two; use mode 'full', selective_ac_option N (every N-th block) or another "
                f"schedule",
            )
        )
    if p.context_parallel_degree > 1 and p.context_parallel_method == "ring" and getattr(args, "cp_gathered", None):
        out.append(
            (
                "zb_latent_ring",
                f"context_parallel_method ring on {cfg.model.name}'s latent attention computes the up-projection's "
                f"weight gradients with the input gradients, which {sched} splits; use context_parallel_method "
                f"allgather, alltoall or hybrid, or {_schedules(lambda f: not f.split_backward)}",
            )
        )
    if cfg.compile.enable:
        out.append(
            (
                "zb_compile",
                f"compile.enable: compiled blocks allow one backward per forward, {sched} runs two; turn "
                f"compile off or use {_schedules(lambda f: not f.split_backward)}",
            )
        )
    return out
