"""DeepSeek-V3's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) for ``DeepseekV3ForCausalLM``.

Names (N = block index, e = expert; the RoPE layouts need no permutation: the interleaved and rotate-half layouts
are the model's own, ``rope_interleave``)::

    layers.N.attention_norm / ffn_norm       model.layers.N.input_layernorm / post_attention_layernorm
    layers.N.attention.wq | wq_a, q_norm, wq_b   self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj
    layers.N.attention.wkv_a, kv_norm, wkv_b, wo  self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    layers.N.feed_forward.w1 / w3 / w2        mlp.gate_proj / up_proj / down_proj (the dense layers)
    layers.N.moe.router.gate.weight           mlp.gate.weight
    layers.N.moe.expert_bias                  mlp.gate.e_score_correction_bias
    layers.N.moe.experts.w1 / w3 / w2[e]      mlp.experts.e.gate_proj / up_proj / down_proj.weight
    layers.N.moe.shared_experts.w1 / w3 / w2  mlp.shared_experts.gate_proj / up_proj / down_proj

The MTP depths sit where DeepSeek's checkpoints keep them, the layers after the last decoder layer (depth k at
``model.layers.{n_layers + k - 1}``): the block's names, and ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
(our ``mtp.k.norm``), with copies of the embedding and the head (``embed_tokens``: our ``mtp.k.embed``, tied to
the token table; ``shared_head.head``: the model shares ``output``; import checks the copies equal the main ones,
export writes them). transformers' own ``DeepseekV3ForCausalLM`` ignores those layers. config.json's
``num_nextn_predict_layers`` says how many depths a checkpoint may have; the depths imported are those whose
weights the files hold (:func:`args_for_weights`).

Import takes the correction bias, updated in training at ``load_balance_coeff`` 1e-3 (DeepSeek-V3's rate for most of
its pre-training) unless ``model.load_balance_coeff`` sets another (0: frozen off, which a non-zero bias refuses);
transformers 5's
fused in-memory experts (``gate_up_proj``, ``down_proj``) import too; export writes every expert apart.
"""

from __future__ import annotations

import re

import torch

from titanlike.models.deepseek_v3.model import DeepseekV3Args
from titanlike.models.hf_common import Experts, check_same_fields, describe_fields

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"

_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}
_MTP["norm.weight"] = "shared_head.norm.weight"
_MTP["embed.weight"] = "embed_tokens.weight"  # tied to the main table: import checks the copy equals it
_MTP_BACK = {v: k for k, v in _MTP.items()}
_MTP_COPIES = {"shared_head.head.weight": "output.weight"}  # the model shares the head: a copy on export
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"(layers\.(\d+)|mtp\.(\d+)\.block)\.(.+)")
_OURS_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_HF = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _hf_layer(fqn_match: re.Match, args: DeepseekV3Args) -> int:
    return int(fqn_match.group(2)) if fqn_match.group(2) is not None else args.n_layers + int(fqn_match.group(3)) - 1


def hf_name(fqn: str, args: DeepseekV3Args | None = None) -> str:
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.fullmatch(fqn)
    if m:
        layer = m.group(2) if m.group(2) is not None else f"<n_layers + {int(m.group(3)) - 1}>"
        if args is not None:
            layer = _hf_layer(m, args)
        rest = m.group(4)
        if rest.startswith("moe.experts."):
            return Experts.hf_name(f"model.layers.{layer}", rest.rpartition(".")[2])
        if rest in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[rest]}"
    m = _OURS_MTP.fullmatch(fqn)
    if m and m.group(2) in _MTP:
        layer = args.n_layers + int(m.group(1)) - 1 if args is not None else f"<n_layers + {int(m.group(1)) - 1}>"
        return f"model.layers.{layer}.{_MTP[m.group(2)]}"
    raise ValueError(f"no Hugging Face DeepSeek-V3 name for parameter '{fqn}'")


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepseekV3Args) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names, every expert apart, the MTP depths as the layers
    after the last one with copies of the embedding and head; new contiguous tensors."""
    out = {}
    for fqn, t in state_dict.items():
        if fqn == "output.weight" and args.tie_embeddings:
            continue
        m = _OURS.fullmatch(fqn)
        if m and m.group(4).startswith("moe.experts."):
            out.update(Experts.to_hf(f"model.layers.{_hf_layer(m, args)}", m.group(4).rpartition(".")[2], t))
            continue
        out[hf_name(fqn, args)] = t.detach().clone().contiguous()
    for k in range(1, args.mtp_layers + 1):
        for theirs, ours in _MTP_COPIES.items():
            if ours in state_dict:
                out[f"model.layers.{args.n_layers + k - 1}.{theirs}"] = state_dict[ours].detach().clone().contiguous()
    return out


def _our_layer(layer: int, args: DeepseekV3Args) -> str:
    return f"layers.{layer}" if layer < args.n_layers else f"mtp.{layer - args.n_layers + 1}.block"


def _from_layer(name: str, t: torch.Tensor, args, out: dict, experts: Experts, copies: dict) -> None:
    m = _HF.fullmatch(name)
    if not m:
        raise ValueError(f"'{name}' is not a Hugging Face DeepSeek-V3 parameter this model has")
    layer, rest = int(m.group(1)), m.group(2)
    prefix = _our_layer(layer, args)
    if layer >= args.n_layers and rest in _MTP_BACK:
        out[f"mtp.{layer - args.n_layers + 1}.{_MTP_BACK[rest]}"] = t
    elif layer >= args.n_layers and rest in _MTP_COPIES:
        copies[name] = (t, _MTP_COPIES[rest])
    elif experts.take(rest, t, prefix, out):
        pass
    elif rest in _BLOCK_BACK:
        out[f"{prefix}.{_BLOCK_BACK[rest]}"] = t
    else:
        raise ValueError(f"'{name}' is not a Hugging Face DeepSeek-V3 parameter this model has")


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: DeepseekV3Args) -> dict[str, torch.Tensor]:
    """A Hugging Face DeepSeek-V3 state dict (per-expert or fused experts; MTP layers after the last decoder
    layer) -> our FQNs; a correction bias the model does not keep (``load_balance_coeff`` None) must be zero, the
    MTP layers' embedding / head copies equal the model's. MTP layers (those with an ``eh_proj``) beyond the model's
    ``mtp_layers`` are dropped (``--model.mtp_layers 0`` trains without them). Whether it is exactly the model's
    state dict is the caller's check."""
    out, experts, copies = {}, Experts(), {}
    mtp_held = {int(m.group(1)) for n in hf_state_dict if (m := _HF.fullmatch(n)) and m.group(2) == "eh_proj.weight"}
    dropped = {i for i in mtp_held if i >= args.n_layers + args.mtp_layers}
    for name, t in hf_state_dict.items():
        m = _HF.fullmatch(name)
        if m and int(m.group(1)) in dropped:
            continue
        if name in _TOP_BACK:
            if not (name == "lm_head.weight" and args.tie_embeddings):
                out[_TOP_BACK[name]] = t
            continue
        _from_layer(name, t, args, out, experts, copies)
    experts.stack_into(out)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    for k in range(1, args.mtp_layers + 1):  # tied to the token table: a stored copy must equal it
        name = f"model.layers.{args.n_layers + k - 1}.embed_tokens.weight"
        if f"mtp.{k}.embed.weight" in out:
            copies[name] = (out.pop(f"mtp.{k}.embed.weight"), "tok_embeddings.weight")
        if "tok_embeddings.weight" in out:
            out[f"mtp.{k}.embed.weight"] = out["tok_embeddings.weight"]
    for name, (t, ours) in copies.items():
        main = out.get(ours)
        if main is not None and t.device.type != "meta" and not torch.equal(t.to(main.dtype), main):
            raise ValueError(f"'{name}' differs from the main model's {_TOP[ours]}; titanlike's MTP shares them")
    if args.load_balance_coeff is None:
        for fqn in [f for f in out if f.endswith(".moe.expert_bias")]:
            t = out.pop(fqn)
            if t.device.type != "meta" and t.abs().max() > 0:
                raise ValueError(
                    f"{_BLOCK['moe.expert_bias']} of {fqn} is not zero: it changes which experts a token picks; "
                    f"import with the correction bias kept (load_balance_coeff set)"
                )
    return out


def args_for_weights(args: DeepseekV3Args, names) -> DeepseekV3Args:
    """``args`` with the MTP depths the checkpoint's weights hold (config.json's ``num_nextn_predict_layers`` is what
    a checkpoint may hold: transformers writes 1 and no MTP weights)."""
    held = {int(m.group(1)) for n in names if (m := _HF.fullmatch(n)) and int(m.group(1)) >= args.n_layers}
    depths = 0
    while args.n_layers + depths in held and depths < args.mtp_layers:
        depths += 1
    return args.replace(mtp_layers=depths)


def import_overrides(args: DeepseekV3Args, overrides: dict) -> tuple[DeepseekV3Args, dict]:
    """The model.* options an import honours over config.json (optional adapter member): ``mtp_layers`` up to the
    depths the weights hold (the others are dropped). Returns the args and the options left to compare; ValueError
    for more depths than the weights hold."""
    left = dict(overrides)
    depths = left.pop("mtp_layers", None)
    if depths is not None and depths > args.mtp_layers:
        raise ValueError(
            f"model.mtp_layers {depths}: its weights hold {args.mtp_layers} MTP depth(s) (config.json's "
            f"num_nextn_predict_layers counts those a checkpoint may hold); set model.mtp_layers 0..{args.mtp_layers}"
        )
    if depths is not None:
        args = args.replace(mtp_layers=depths)
    return args, left


def export_violations(args: DeepseekV3Args) -> list[str]:
    """What ``DeepseekV3ForCausalLM`` cannot express (checked before training starts)."""
    out = []
    if args.score_func != "sigmoid" and args.num_experts:
        out.append(
            f"checkpoint.export_safetensors: DeepseekV3ForCausalLM routes by sigmoid scores, this model by "
            f"{args.score_func}; turn export_safetensors off"
        )
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return ""


_ROUTING = ("score_func", "route_norm", "route_scale", "num_groups", "topk_groups")
ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "ffn_hidden_dim",
    "n_dense_layers",
    "moe_hidden_dim",
    "num_experts",
    "top_k",
    "num_shared_experts",
    *_ROUTING,
    "vocab_size",
    "tie_embeddings",
    "rope_theta",
    "rope_interleave",
    "rope_scaling",
    "norm_eps",
)
_YARN = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
    "attention_factor": "rope_attention_factor",
    "truncate": "rope_truncate",
}
# read, or checked to hold the one value titanlike builds (_FIXED)
_FIELDS = {
    "hidden_size": "dim",
    "intermediate_size": "ffn_hidden_dim",
    "moe_intermediate_size": "moe_hidden_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "n_shared_experts": "num_shared_experts",
    "n_routed_experts": "num_experts",
    "routed_scaling_factor": "route_scale",
    "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "n_group": "num_groups",
    "topk_group": "topk_groups",
    "num_experts_per_tok": "top_k",
    "first_k_dense_replace": "n_dense_layers",
    "norm_topk_prob": "route_norm",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "rope_interleave": "rope_interleave",
    "vocab_size": "vocab_size",
}
_FIXED = {
    "hidden_act": ("silu", "swish"),
    "attention_bias": (False,),
    "attention_dropout": (0, 0.0),
    "pretraining_tp": (1,),
    "topk_method": ("noaux_tc",),  # DeepSeek's own config.json: group-limited, bias-corrected selection
    "scoring_func": ("sigmoid",),
    "moe_layer_freq": (1,),
    "ep_size": (1,),
}
# training-loss or inference settings that change no weight
_IGNORED = {"output_router_logits", "aux_loss_alpha", "seq_aux", "use_cache", "rope_theta", "rope_scaling"}
_IGNORED |= {"rope_parameters", "q_lora_rank", "num_key_value_heads", "head_dim", "qk_head_dim"}
_IGNORED |= {"num_nextn_predict_layers", "num_mtp_layers"}


def hf_config(args: DeepseekV3Args, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``DeepseekV3ForCausalLM`` config.json for ``args`` in the layout of transformers ``layout`` (4 or 5)."""
    config = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    config.update({theirs: getattr(args, ours) for theirs, ours in _FIELDS.items()})
    config.update(
        q_lora_rank=args.q_lora_rank or None,
        num_key_value_heads=args.n_heads,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        num_nextn_predict_layers=args.mtp_layers,
        initializer_range=0.02,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    rope = {"rope_type": "default"}
    if args.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", **{theirs: getattr(args, ours) for theirs, ours in _YARN.items()}}
        if not args.rope_attention_factor:
            rope.pop("attention_factor")
    if layout >= 5:
        config["rope_parameters"] = {"rope_theta": args.rope_theta, **rope}
        config["dtype"] = str(dtype).removeprefix("torch.")
    else:
        config["rope_theta"] = args.rope_theta
        config["rope_scaling"] = None if args.rope_scaling == "none" else {**rope, "type": rope["rope_type"]}
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def _rope(config: dict, problems: list[str]) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters = {rope!r} is not an object")
        return {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind not in ("default", "yarn"):
        problems.append(f"rope type {kind!r} (titanlike's DeepSeek-V3 has the default RoPE or YaRN)")
        return out
    known = {"rope_type", "type", "rope_theta", *(_YARN if kind == "yarn" else ())}
    for key in sorted(set(rope) - known):
        problems.append(f"rope_parameters.{key} = {rope[key]!r} (not read by titanlike's {kind} RoPE)")
    if kind == "yarn":
        out["rope_scaling"] = "yarn"
        out.update({ours: rope[theirs] for theirs, ours in _YARN.items() if rope.get(theirs) is not None})
    return out


def _config_problems(config: dict) -> list[str]:
    problems = []
    for key, accepted in _FIXED.items():
        if key in config and config[key] not in accepted:
            problems.append(f"{key} = {config[key]!r} (titanlike's DeepSeek-V3 has {accepted[0]!r})")
    heads = config.get("num_attention_heads")
    if config.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads = {config['num_key_value_heads']!r} (MLA: one per head, {heads})")
    for key in sorted(set(config) - set(_FIELDS) - set(_FIXED) - _IGNORED):
        problems.append(f"{key} = {config[key]!r} (a field titanlike's DeepSeek-V3 does not know)")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    return problems


def model_args_from_hf_config(config: dict) -> DeepseekV3Args:
    """DeepseekV3Args of a Hugging Face DeepSeek-V3 config.json's fields; ValueError naming every field titanlike
    cannot honour, in one line. ``mtp_layers`` is config.json's ``num_nextn_predict_layers`` (then cut to the depths
    the weights hold: :func:`args_for_weights`)."""
    problems = _config_problems(config)
    rope = _rope(config, problems)
    args = None
    if not problems:
        try:
            fields = {ours: config[theirs] for theirs, ours in _FIELDS.items() if config.get(theirs) is not None}
            args = DeepseekV3Args(
                **fields,
                **rope,
                q_lora_rank=int(config.get("q_lora_rank") or 0),
                mtp_layers=int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0),
                score_func="sigmoid",
                load_balance_coeff=1e-3,
                aux_loss_coeff=0.0,
            )
            if args.num_experts:
                args.moe_args()
        except (TypeError, ValueError) as e:
            problems.append(f"a value does not fit ({e})")
    if problems:
        raise ValueError("; ".join(problems))
    return args


def describe(args: DeepseekV3Args) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return describe_fields(args, (*ARCH_FIELDS, "mtp_layers", "max_seq_len"))


def check_same_architecture(args: DeepseekV3Args, ours: DeepseekV3Args, source: str) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours`` (the MTP depths
    aside: a checkpoint may hold fewer than config.json names, :func:`args_for_weights`)."""
    check_same_fields(args, ours, source, ARCH_FIELDS)
