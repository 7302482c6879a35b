"""Qwen3-Next's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) for ``Qwen3NextForCausalLM``.

Names (N = block index, e = expert)::

    layers.N.attention_norm / ffn_norm.weight     model.layers.N.input_layernorm / post_attention_layernorm.weight
    layers.N.attention.wq/wk/wv/wo.weight         model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.N.attention.q_norm/k_norm.weight       model.layers.N.self_attn.q_norm/k_norm.weight
    layers.N.linear_attn.in_proj_qkvz/in_proj_ba/out_proj/norm.weight   the same names
    layers.N.linear_attn.conv.weight (C, K)       model.layers.N.linear_attn.conv1d.weight (C, 1, K), channels permuted
    layers.N.linear_attn.decay.A_log / dt_bias    model.layers.N.linear_attn.A_log / dt_bias
    layers.N.moe.router.gate.weight               model.layers.N.mlp.gate.weight
    layers.N.moe.experts.w1/w3/w2[e]              model.layers.N.mlp.experts.e.gate_proj/up_proj/down_proj.weight
    layers.N.moe.shared_experts.w1/w3/w2.weight   model.layers.N.mlp.shared_expert.gate_proj/up_proj/down_proj.weight
    layers.N.moe.shared_gate.weight               model.layers.N.mlp.shared_expert_gate.weight
    layers.N.feed_forward.w1/w3/w2.weight         model.layers.N.mlp.gate_proj/up_proj/down_proj.weight (no experts)

The conv's channels: transformers orders them ``[q of every key head | k | v]``, titanlike by key-head group
(``q_i | k_i | v_i``, as ``in_proj_qkvz``), so that a tensor-parallel rank's channels are one contiguous block; the
adapter permutes. Experts: import takes the per-expert tensors or transformers 5's fused in-memory form
(``gate_up_proj`` (E, 2 I, H), ``down_proj`` (E, H, I)); export writes per-expert tensors. The multi-token-prediction
weights of Qwen's checkpoints (``mtp.*``) are not part of the causal LM (transformers drops them on load too): import
sets them aside.

config.json: every field is honoured, set aside as metadata by ``titanlike.hf``, or refused (all at once): another
``layer_types`` pattern than every ``full_attention_interval``-th layer full, ``mlp_only_layers`` or
``decoder_sparse_step`` other than MoE in every layer, attention biases, another activation or RoPE type.
"""

from __future__ import annotations

import re

import torch

from titanlike.models.hf_common import Experts, Names, check_same_fields, describe_fields
from titanlike.models.qwen3_next.model import LAYER_TYPES, Qwen3NextArgs

MODEL_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
READS_GENERIC = ("layer_types",)  # which layers are linear attention: read here, not set aside

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "linear_attn.in_proj_qkvz.weight": "linear_attn.in_proj_qkvz.weight",
    "linear_attn.in_proj_ba.weight": "linear_attn.in_proj_ba.weight",
    "linear_attn.out_proj.weight": "linear_attn.out_proj.weight",
    "linear_attn.norm.weight": "linear_attn.norm.weight",
    "linear_attn.conv.weight": "linear_attn.conv1d.weight",
    "linear_attn.decay.A_log": "linear_attn.A_log",
    "linear_attn.decay.dt_bias": "linear_attn.dt_bias",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_NAMES = Names("Qwen3-Next", _TOP, _LAYER, "model.layers.")
_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_CONV = re.compile(r"layers\.(\d+)\.linear_attn\.conv\.weight")
_HF_CONV = re.compile(r"model\.layers\.(\d+)\.linear_attn\.conv1d\.weight")


def hf_name(fqn: str) -> str:
    m = _OURS_EXPERTS.fullmatch(fqn)
    if m:
        return Experts.hf_name(f"model.layers.{m.group(1)}", m.group(2))
    return _NAMES.hf_name(fqn)


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return " (transformers' conv1d weight is (C, 1, K))" if fqn.endswith("conv.weight") else ""


def _conv_order(args: Qwen3NextArgs) -> torch.Tensor:
    """For each of our conv channels (grouped by key head: ``q_i | k_i | v_i``) its transformers channel
    (``[q | k | v]``)."""
    nk, dk = args.linear_k_heads, args.linear_k_head_dim
    vg = args.value_dim // nk  # value channels per key-head group
    kd = args.key_dim
    order = []
    for i in range(nk):
        order += range(i * dk, (i + 1) * dk)  # q_i
        order += range(kd + i * dk, kd + (i + 1) * dk)  # k_i
        order += range(2 * kd + i * vg, 2 * kd + (i + 1) * vg)  # v_i
    return torch.tensor(order)


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3NextArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face names and layouts (per-expert tensors, the conv as (C, 1, K) in
    transformers' channel order); new contiguous tensors."""
    out = {}
    order = _conv_order(args)
    for fqn, t in state_dict.items():
        if fqn.endswith("moe.expert_bias"):
            continue  # none when imported (load_balance_coeff None); export_violations refuses a trained one
        m = _OURS_EXPERTS.fullmatch(fqn)
        if m:
            out.update(Experts.to_hf(f"model.layers.{m.group(1)}", m.group(2), t))
            continue
        if fqn == "output.weight" and args.tie_embeddings:
            continue
        if _CONV.fullmatch(fqn):
            back = torch.empty_like(t)
            back[order] = t
            out[_NAMES.hf_name(fqn)] = back.unsqueeze(1).contiguous()
            continue
        out[_NAMES.hf_name(fqn)] = t.detach().clone().contiguous()
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3NextArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen3-Next state dict -> our FQNs (experts stacked, the conv in our channel order, ``mtp.*``
    set aside); whether it is exactly the model's state dict is the caller's check."""
    experts, out = Experts(), {}
    order = _conv_order(args)
    for name, t in hf_state_dict.items():
        if name.startswith("mtp."):
            continue
        m = _HF_LAYER.fullmatch(name)
        if m and experts.take(m.group(2), t, f"layers.{m.group(1)}", out):
            continue
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        m = _HF_CONV.fullmatch(name)
        if m:
            out[f"layers.{m.group(1)}.linear_attn.conv.weight"] = t.reshape(t.shape[0], -1)[order]
            continue
        out[_NAMES.our_name(name)] = t
    experts.stack_into(out)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def export_violations(args: Qwen3NextArgs) -> list[str]:
    """Why a model of ``args`` cannot be exported to ``Qwen3NextForCausalLM`` (checked before training starts)."""
    if args.num_experts and args.load_balance_coeff is not None:
        return [
            "checkpoint.export_safetensors: Qwen3NextForCausalLM has no expert bias, and this model trains one "
            f"(load_balance_coeff {args.load_balance_coeff}); set it to None, or turn export_safetensors off"
        ]
    return []


def hf_config(args: Qwen3NextArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``Qwen3NextForCausalLM`` config.json for ``args`` (transformers 5's layout: ``rope_parameters``)."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "linear_conv_kernel_dim": args.conv_kernel,
        "linear_key_head_dim": args.linear_k_head_dim,
        "linear_value_head_dim": args.linear_v_head_dim,
        "linear_num_key_heads": args.linear_k_heads,
        "linear_num_value_heads": args.linear_v_heads,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "full_attention_interval": args.full_attention_interval,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": args.moe_hidden_dim,
        "shared_expert_intermediate_size": args.shared_hidden_dim,
        "num_experts_per_tok": args.top_k,
        "num_experts": args.num_experts,
        "norm_topk_prob": args.route_norm,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "rope_parameters": {
            "rope_theta": args.rope_theta,
            "rope_type": "default",
            "partial_rotary_factor": args.partial_rotary_factor,
        },
    }
    config["dtype" if layout >= 5 else "torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


_FIELDS = {  # config.json field -> (our field, type)
    "hidden_size": ("dim", int),
    "num_hidden_layers": ("n_layers", int),
    "num_attention_heads": ("n_heads", int),
    "num_key_value_heads": ("n_kv_heads", int),
    "head_dim": ("head_dim", int),
    "intermediate_size": ("ffn_hidden_dim", int),
    "linear_conv_kernel_dim": ("conv_kernel", int),
    "linear_key_head_dim": ("linear_k_head_dim", int),
    "linear_value_head_dim": ("linear_v_head_dim", int),
    "linear_num_key_heads": ("linear_k_heads", int),
    "linear_num_value_heads": ("linear_v_heads", int),
    "full_attention_interval": ("full_attention_interval", int),
    "moe_intermediate_size": ("moe_hidden_dim", int),
    "shared_expert_intermediate_size": ("shared_hidden_dim", int),
    "num_experts_per_tok": ("top_k", int),
    "num_experts": ("num_experts", int),
    "norm_topk_prob": ("route_norm", bool),
    "vocab_size": ("vocab_size", int),
    "max_position_embeddings": ("max_seq_len", int),
    "rms_norm_eps": ("norm_eps", float),
    "tie_word_embeddings": ("tie_embeddings", bool),
}
_CHECKED = {"layer_types", "decoder_sparse_step", "mlp_only_layers", "hidden_act", "attention_bias"}
_CHECKED |= {"attention_dropout", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"}
_CHECKED |= {"router_aux_loss_coef", "output_router_logits"}  # Hugging Face's training loss, not the weights


def _rope(config: dict, problems: list[str]) -> tuple[float, float]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters = {rope!r} is not an object")
        return 10000.0, 0.25
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        problems.append(f"rope type {kind!r} (titanlike's Qwen3-Next has the default RoPE)")
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        problems.append(f"rope_parameters {', '.join(extra)} (titanlike's Qwen3-Next has no RoPE scaling)")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))


def _structure_problems(config: dict, args: Qwen3NextArgs) -> list[str]:
    out = []
    types = config.get("layer_types")
    if types is not None:
        want = [args.layer_type(i) for i in range(args.n_layers)]
        if list(types) != want:
            bad = sorted(set(types) - set(LAYER_TYPES))
            out.append(
                f"layer_types = {types!r} (titanlike's Qwen3-Next has every full_attention_interval-th layer full "
                f"attention: {want})" + (f"; unknown types {bad}" if bad else "")
            )
    if config.get("decoder_sparse_step", 1) != 1 or list(config.get("mlp_only_layers") or []):
        out.append("decoder_sparse_step / mlp_only_layers: titanlike's Qwen3-Next has the MoE in every layer")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        out.append(f"hidden_act = {config['hidden_act']!r} (titanlike's Qwen3-Next has 'silu')")
    if config.get("attention_bias"):
        out.append("attention_bias = True (titanlike's Qwen3-Next has no attention biases)")
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        out.append(f"attention_dropout = {config['attention_dropout']!r} (titanlike has no attention dropout)")
    if args.linear_v_heads % args.linear_k_heads:
        out.append(f"linear_num_value_heads {args.linear_v_heads} is not a multiple of the key heads")
    return out


def model_args_from_hf_config(config: dict) -> Qwen3NextArgs:
    """Qwen3NextArgs of a Hugging Face Qwen3-Next config.json's fields; ValueError naming every field titanlike
    cannot honour, in one line."""
    problems = [f"{k} = {config[k]!r} (a field titanlike's Qwen3-Next does not know)" for k in sorted(config)]
    problems = [p for p, k in zip(problems, sorted(config)) if k not in _FIELDS and k not in _CHECKED]
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    theta, partial = _rope(config, problems)
    values = {}
    for key, (field, kind) in _FIELDS.items():
        if key in config and config[key] is not None:
            try:
                values[field] = kind(config[key])
            except (TypeError, ValueError):
                problems.append(f"{key} = {config[key]!r} is not a {kind.__name__}")
    types = config.get("layer_types")
    if "full_attention_interval" not in values and types and "full_attention" in types:
        values["full_attention_interval"] = list(types).index("full_attention") + 1  # transformers keeps only the list
    args = None
    if not missing:
        args = Qwen3NextArgs(**values, rope_theta=theta, partial_rotary_factor=partial, load_balance_coeff=None)
        problems += _structure_problems(config, args)
    if problems:
        raise ValueError("; ".join(problems))
    return args


ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "partial_rotary_factor",
    "full_attention_interval",
    "linear_k_heads",
    "linear_v_heads",
    "linear_k_head_dim",
    "linear_v_head_dim",
    "conv_kernel",
    "ffn_hidden_dim",
    "moe_hidden_dim",
    "num_experts",
    "top_k",
    "shared_hidden_dim",
    "vocab_size",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
)


def describe(args: Qwen3NextArgs) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return describe_fields(args, (*ARCH_FIELDS, "max_seq_len"))


def check_same_architecture(args: Qwen3NextArgs, ours: Qwen3NextArgs, source: str) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours``."""
    check_same_fields(args, ours, source, ARCH_FIELDS)
