"""gpt-oss's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) for ``GptOssForCausalLM``.

Names (N = block index)::

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.N.attention.wq/wk/wv/wo.*       model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.{weight,bias}
    layers.N.attention.sinks.weight        model.layers.N.self_attn.sinks
    layers.N.attention_norm.weight         model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight               model.layers.N.post_attention_layernorm.weight
    layers.N.moe.router.gate.*             model.layers.N.mlp.router.{weight,bias}
    layers.N.moe.experts.w1 / w3, b1 / b3  model.layers.N.mlp.experts.gate_up_proj (E, H, 2 I) / gate_up_proj_bias
                                           (E, 2 I): gate the even columns, up the odd ones (interleaved), transposed
    layers.N.moe.experts.w2, b2            model.layers.N.mlp.experts.down_proj (E, I, H) transposed, down_proj_bias
    norm.weight, output.weight             model.norm.weight, lm_head.weight

**MXFP4** (the published checkpoints, ``quantization_config.quant_method = "mxfp4"``): each expert projection is
stored as ``<proj>_blocks`` (E, out, G, 16) uint8, two E2M1 values per byte (the low nibble first), and
``<proj>_scales`` (E, out, G) uint8, an E8M0 exponent (bias 127) per block of 32 values along the input features;
:func:`dequantize_mxfp4` turns them into the unquantized tensor (E, in, out) in the training dtype (the dtype the
checkpoint's other tensors load in), then the layout above applies. Export writes the unquantized form.

config.json: every field is honoured, is metadata (set aside by ``titanlike.hf``), or is refused (all at once, with its
value): another activation or RoPE type, attention dropout, a tied head with gpt-oss's untied shapes is honoured.
``router_aux_loss_coef`` / ``output_router_logits`` configure transformers' training loss, not the weights: set
aside. An imported model has no expert-bias balancing and no aux loss (as transformers').
"""

from __future__ import annotations

import re

import torch

from titanlike.models.gpt_oss.model import LAYER_TYPES, GptOssArgs
from titanlike.models.hf_common import Names, check_same_fields, describe_fields

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
QUANTIZATION_METHODS = ("mxfp4",)  # dequantized on import (titanlike.hf accepts these quantization_configs)
READS_GENERIC = ("layer_types",)  # a field titanlike.hf sets aside for other models: which layers slide

_LAYER = {
    **{f"attention.w{a}.{p}": f"self_attn.{a}_proj.{p}" for a in "qkvo" for p in ("weight", "bias")},
    "attention.sinks.weight": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP_HEAD = {"output.weight": "lm_head.weight"}
_NAMES = Names("gpt-oss", {**_TOP, **_TOP_HEAD}, _LAYER, "model.layers.")
_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3|b1|b2|b3)")
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_EXPERT_HF = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
_EXPERT_HF.update({"b1": "gate_up_proj_bias", "b3": "gate_up_proj_bias", "b2": "down_proj_bias"})
# E2M1 code -> value (sign bit 3), as OCP's MX spec and transformers.integrations.mxfp4.FP4_VALUES
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def hf_name(fqn: str) -> str:
    m = _OURS_EXPERTS.fullmatch(fqn)
    if m:
        return f"model.layers.{m.group(1)}.mlp.experts.{_EXPERT_HF[m.group(2)]}"
    return _NAMES.hf_name(fqn)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks`` (E, out, G, 16) uint8 and ``scales`` (E, out, G) uint8 -> (E, in = 32 G, out) in ``dtype``:
    value = E2M1(nibble) x 2^(scale - 127), the low nibble the even element of each pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4: blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} are "
            f"not uint8 (E, out, G, 16) / (E, out, G)"
        )
    lut = torch.tensor(_FP4, dtype=dtype, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)  # (.., G, 32)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).to(dtype)
    return values.flatten(-2).transpose(1, 2).contiguous()


def to_hf(state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names and layouts (gate / up interleaved, transposed);
    new contiguous tensors; a tied head left out. Load counters and an expert bias are not weights of gpt-oss."""
    out, experts = {}, {}
    for fqn, t in state_dict.items():
        m = _OURS_EXPERTS.fullmatch(fqn)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = t.detach()
        elif fqn.endswith(".moe.expert_bias") or (fqn == "output.weight" and args.tie_embeddings):
            continue
        else:
            out[_NAMES.hf_name(fqn)] = t.detach().clone().contiguous()
    for layer, e in experts.items():
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.stack((e["w1"], e["w3"]), dim=2).flatten(1, 2)  # (E, 2 I, H): rows gate0, up0, gate1, ...
        out[p + "gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        out[p + "gate_up_proj_bias"] = torch.stack((e["b1"], e["b3"]), dim=2).flatten(1, 2).contiguous()
        out[p + "down_proj"] = e["w2"].transpose(1, 2).contiguous()
        out[p + "down_proj_bias"] = e["b2"].clone().contiguous()
    return out


def _experts_from_hf(layer: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's expert tensors (Hugging Face suffix -> tensor, MXFP4 or not) -> our w1 w2 w3 b1 b2 b3."""
    dtype = next((t.dtype for t in parts.values() if t.is_floating_point()), torch.float32)
    for proj in ("gate_up_proj", "down_proj"):
        if proj + "_blocks" in parts:
            parts[proj] = dequantize_mxfp4(parts.pop(proj + "_blocks"), parts.pop(proj + "_scales"), dtype)
    p = f"layers.{layer}.moe.experts."
    out = {}
    if "gate_up_proj" in parts:
        gate_up = parts["gate_up_proj"].transpose(1, 2)  # (E, 2 I, H)
        out[p + "w1"], out[p + "w3"] = gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous()
    if "gate_up_proj_bias" in parts:
        b = parts["gate_up_proj_bias"]
        out[p + "b1"], out[p + "b3"] = b[:, 0::2].contiguous(), b[:, 1::2].contiguous()
    if "down_proj" in parts:
        out[p + "w2"] = parts["down_proj"].transpose(1, 2).contiguous()
    if "down_proj_bias" in parts:
        out[p + "b2"] = parts["down_proj_bias"]
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face gpt-oss state dict (MXFP4 experts dequantized) -> our FQNs; whether it is exactly the model's
    state dict is the caller's check."""
    out, experts = {}, {}
    for name, t in hf_state_dict.items():
        m = _HF_EXPERTS.fullmatch(name)
        if m:
            experts.setdefault(m.group(1), {})[m.group(2) + (m.group(3) or "")] = t
        elif name == "lm_head.weight" and args.tie_embeddings:
            continue
        else:
            out[_NAMES.our_name(name)] = t
    for layer, parts in experts.items():
        out.update(_experts_from_hf(layer, parts))
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    if args.load_balance_coeff is not None:
        for i in range(args.n_layers):
            out[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.num_experts, dtype=torch.float32)
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return " (experts: gate_up_proj is (experts, hidden, 2 x intermediate))" if ".experts." in fqn else ""


def hf_config(args: GptOssArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``GptOssForCausalLM`` config.json for ``args`` (transformers >= 4.55 has gpt-oss; ``layout`` 5 writes
    ``rope_parameters`` and ``dtype``, 4 ``rope_scaling`` / ``rope_theta`` and ``torch_dtype``)."""
    rope = {
        "rope_type": "yarn",
        "factor": args.rope_scaling_factor,
        "beta_fast": args.rope_beta_fast,
        "beta_slow": args.rope_beta_slow,
        "truncate": args.rope_truncate,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }
    if args.rope_attention_factor:
        rope["attention_factor"] = args.rope_attention_factor
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "sliding_window": args.sliding_window,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "attention_bias": args.attention_bias,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if layout >= 5:
        config["rope_parameters"] = {**rope, "rope_theta": args.rope_theta}
        config["dtype"] = str(dtype).removeprefix("torch.")
    else:
        config["rope_scaling"], config["rope_theta"] = rope, args.rope_theta
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


_HONOURED = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "sliding_window",
        "layer_types",
        "attention_bias",
        "swiglu_alpha",
        "swiglu_limit",
        "hidden_act",
        "attention_dropout",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "router_aux_loss_coef",  # transformers' training loss, not the weights
        "output_router_logits",
    }
)
_ROPE_KEYS = {"rope_type", "type", "factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"}


def _rope(config: dict, problems: list[str]) -> dict:
    """The YaRN fields of GptOssArgs from rope_parameters (5) / rope_scaling + rope_theta (4)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters = {rope!r} is not an object")
        return {}
    kind = rope.get("rope_type", rope.get("type", "yarn"))
    if kind != "yarn":
        problems.append(f"rope type {kind!r} (titanlike's gpt-oss has YaRN RoPE)")
    extra = sorted(set(rope) - _ROPE_KEYS - {"rope_theta", "attention_factor"})
    if extra:
        problems.append(
            f"rope_parameters {', '.join(extra)} (titanlike's YaRN has factor, beta_fast, beta_slow, "
            f"truncate, original_max_position_embeddings, attention_factor)"
        )
    d = GptOssArgs()
    theta = rope.get("rope_theta", config.get("rope_theta", d.rope_theta))
    return dict(
        rope_theta=float(theta),
        rope_scaling_factor=float(rope.get("factor", d.rope_scaling_factor)),
        rope_beta_fast=float(rope.get("beta_fast", d.rope_beta_fast)),
        rope_beta_slow=float(rope.get("beta_slow", d.rope_beta_slow)),
        rope_truncate=bool(rope.get("truncate", True)),
        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", d.rope_original_max_seq_len)),
        rope_attention_factor=float(rope.get("attention_factor") or 0.0),
    )


def model_args_from_hf_config(config: dict) -> GptOssArgs:
    """GptOssArgs of a Hugging Face gpt-oss config.json's fields; ValueError naming every field titanlike cannot
    honour, in one line."""
    problems: list[str] = []
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"hidden_act = {config['hidden_act']!r} (gpt-oss's experts are the clamped SwiGLU)")
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        problems.append(f"attention_dropout = {config['attention_dropout']!r} (titanlike has no attention dropout)")
    for key in sorted(set(config) - _HONOURED):
        problems.append(f"{key} = {config[key]!r} (a field titanlike's gpt-oss does not know)")
    types = tuple(config.get("layer_types") or ())
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or (types and len(types) != config.get("num_hidden_layers")):
        problems.append(f"layer_types = {list(types)!r} (one of {', '.join(LAYER_TYPES)} per layer)")
    if config.get("sliding_window") is None and "sliding_attention" in types:
        problems.append("sliding_window = None with sliding_attention layers")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in config]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    rope = _rope(config, problems)
    if problems:
        raise ValueError("; ".join(problems))
    n_heads = int(config["num_attention_heads"])
    return GptOssArgs(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
        moe_hidden_dim=int(config["intermediate_size"]),
        num_experts=int(config.get("num_local_experts", config.get("num_experts", 128))),
        top_k=int(config.get("num_experts_per_tok", 4)),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        max_seq_len=int(config.get("max_position_embeddings", 131072)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(config.get("sliding_window") or 128),
        layer_types=types,
        attention_bias=bool(config.get("attention_bias", True)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        load_balance_coeff=None,
        **rope,
    )


ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "moe_hidden_dim",
    "num_experts",
    "top_k",
    "vocab_size",
    "tie_embeddings",
    "sliding_window",
    "attention_sinks",
    "attention_bias",
    "rope_theta",
    "norm_eps",
)


def describe(args: GptOssArgs) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return describe_fields(args, (*ARCH_FIELDS, "max_seq_len"))


def check_same_architecture(args: GptOssArgs, ours: GptOssArgs, source: str) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours``."""
    check_same_fields(args, ours, source, ARCH_FIELDS)
    if [args.layer_type(i) for i in range(args.n_layers)] != [ours.layer_type(i) for i in range(ours.n_layers)]:
        raise ValueError(f"{source} is for a different model: its layer types differ")


def export_violations(args: GptOssArgs) -> list[str]:
    """Why a model of ``args`` cannot be exported to ``GptOssForCausalLM`` (checked before training starts)."""
    out = []
    if args.load_balance_coeff is not None:
        out.append(
            "checkpoint.export_safetensors: GptOssForCausalLM has no expert bias, and this model trains one "
            f"(load_balance_coeff {args.load_balance_coeff}); turn export_safetensors off"
        )
    if not args.attention_sinks or not args.attention_bias:
        out.append(
            "checkpoint.export_safetensors: GptOssForCausalLM always has attention sinks and biases; this model lacks "
            "them (model.attention_sinks false); turn export_safetensors off"
        )
    return out
