"""Llama's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`): our state dict <-> ``LlamaForCausalLM`` names,
the RoPE row permutation, config.json fields.

Names::

    tok_embeddings.weight                      model.embed_tokens.weight
    layers.N.attention.wq/wk/wv/wo.weight      model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.N.feed_forward.w1/w3/w2.weight      model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    layers.N.attention_norm.weight             model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight                   model.layers.N.post_attention_layernorm.weight
    norm.weight                                model.norm.weight
    output.weight                              lm_head.weight (left out when the embeddings are tied)

**RoPE layout.** Our attention rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout, see
``apply_rope``); Hugging Face's rotates ``(x[i], x[i + head_dim/2])`` ("rotate half"). So the rows of ``wq`` and
``wk`` are permuted within every head on export, exactly as Meta's ``convert_llama_weights_to_hf.py`` does: row
``2i + c`` of a head becomes row ``c * head_dim/2 + i``. Queries and keys are permuted the same way, so their dot
products, and everything after them, are unchanged: the exported model computes the same logits.

**config.json.** Every field (besides the metadata :mod:`titanlike.hf` sets aside) either maps to a ModelArgs field
or is refused with one line naming the field and its value (all such fields at once). Both layouts are read:
transformers 4's top-level ``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``; export
writes the layout it is given (``titanlike.hf.hf_config``: the installed transformers').
"""

from __future__ import annotations

import re

import torch

from titanlike.models.hf_common import decoder_hf_config, set_rope_and_dtype
from titanlike.models.llama.model import ModelArgs

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"

_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_TO_OURS_LAYER = {v: k for k, v in _LAYER_MAP.items()}
_HF_TO_OURS_TOP = {v: k for k, v in _TOP_MAP.items()}
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer old exports carry


# ------------------------------------------------------------------------------------------------ the permutation
def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved-pair RoPE order to rotate-half order (per head)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ------------------------------------------------------------------------------------------------ names
def _rename(name: str, top: dict[str, str], layer: re.Pattern, per_layer: dict[str, str], prefix: str) -> str | None:
    """``name`` through the top-level map, or its per-layer part through ``per_layer`` (None: no such name)."""
    if name in top:
        return top[name]
    m = layer.fullmatch(name)
    return f"{prefix}{m.group(1)}.{per_layer[m.group(2)]}" if m and m.group(2) in per_layer else None


def hf_name(fqn: str) -> str:
    """The Hugging Face name of one of our parameter FQNs."""
    out = _rename(fqn, _TOP_MAP, _OURS_LAYER, _LAYER_MAP, "model.layers.")
    if out is None:
        raise ValueError(f"no Hugging Face Llama name for parameter '{fqn}'")
    return out


def our_name(name: str) -> str:
    """Our FQN of a Hugging Face Llama parameter name."""
    out = _rename(name, _HF_TO_OURS_TOP, _HF_LAYER, _HF_TO_OURS_LAYER, "layers.")
    if out is None:
        raise ValueError(f"'{name}' is not a Hugging Face Llama parameter this model has")
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names, q/k rows permuted; new contiguous tensors."""
    out = {}
    for fqn, t in state_dict.items():
        if fqn == "output.weight" and args.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        if fqn.endswith("attention.wq.weight"):
            t = permute_to_hf(t, args.n_heads)
        elif fqn.endswith("attention.wk.weight"):
            t = permute_to_hf(t, args.n_kv_heads)
        out[hf_name(fqn)] = t.detach().clone().contiguous()
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict -> our FQNs (q/k rows un-permuted). With tied embeddings ``output.weight`` is
    the embedding (our state dict lists both names); ``titanlike.hf.from_hf`` checks the result fits the model."""
    out = {}
    if args.tie_embeddings and "lm_head.weight" in hf_state_dict:
        raise ValueError(
            "the Hugging Face weights do not fit the model: the file has lm_head.weight, which a model "
            "with tied embeddings (tie_word_embeddings true) has not"
        )
    for name, t in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        fqn = our_name(name)
        if fqn.endswith("attention.wq.weight"):
            t = permute_from_hf(t, args.n_heads)
        elif fqn.endswith("attention.wk.weight"):
            t = permute_from_hf(t, args.n_kv_heads)
        out[fqn] = t
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    """A vocabulary mismatch of the embedding or head: how to import such weights."""
    if fqn in ("tok_embeddings.weight", "output.weight") and got[1:] == want[1:]:
        return (
            f"; the vocabulary differs ({got[0]} vs {want[0]}): give the folder with its config.json (the "
            f"architecture is then taken from it), or set model.vocab_multiple 1 and a tokenizer of that size"
        )
    return ""


# ------------------------------------------------------------------------------------------------ config.json
# Fields whose value must be the one this model implements: field -> (accepted values, what titanlike has).
_FIXED_FIELDS = {
    "hidden_act": (("silu", "swish"), "SwiGLU with silu"),
    "attention_bias": ((False,), "no attention biases"),
    "mlp_bias": ((False,), "no MLP biases"),
    "attention_dropout": ((0, 0.0), "no attention dropout"),
    "partial_rotary_factor": ((1, 1.0), "RoPE on the whole head"),
}
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


# LlamaConfig fields that do not change what the weights compute (pretraining_tp > 1 only slices the same matmuls).
_IGNORED = frozenset({"pretraining_tp"})


def _rope_dict(args: ModelArgs, layout: int) -> dict | None:
    if args.rope_scaling == "none":
        return {"rope_theta": args.rope_theta, "rope_type": "default"} if layout >= 5 else None
    d = {
        "factor": args.rope_scaling_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
        "rope_type": "llama3",
    }
    if layout >= 5:
        d["rope_theta"] = args.rope_theta
    return dict(sorted(d.items()))


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``LlamaForCausalLM`` config.json for ``args``, in the layout of transformers ``layout`` (4 or 5): 5 has
    ``rope_parameters`` and ``dtype``, 4 top-level ``rope_theta`` / ``rope_scaling`` and ``torch_dtype``. Both load
    in both versions."""
    config = decoder_hf_config(ARCHITECTURE, MODEL_TYPE, args, bos_id, eos_id, mlp_bias=False, pretraining_tp=1)
    return set_rope_and_dtype(
        config, dtype, layout, args.rope_theta, _rope_dict(args, 5), rope_scaling=_rope_dict(args, 4)
    )


def _rope_from_config(config: dict, problems: list[str]) -> dict:
    """ModelArgs rope fields from either layout; problems appended for anything not honoured."""
    top_theta = config.get("rope_theta")
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if params is not None and scaling is not None:
        if not (
            isinstance(params, dict)
            and isinstance(scaling, dict)
            and all(params.get(k) == v for k, v in scaling.items() if k != "type")
        ):
            problems.append(f"rope_parameters = {params!r} and rope_scaling = {scaling!r} disagree")
    rope = params if params is not None else scaling
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        problems.append(f"{'rope_parameters' if params is not None else 'rope_scaling'} = {rope!r} is not an object")
        return {}
    if any(isinstance(v, dict) for v in rope.values()):
        problems.append(f"rope_parameters = {rope!r}: per-layer-type RoPE is not supported (one RoPE for all layers)")
        return {}
    theta = rope.get("rope_theta")
    if theta is not None and top_theta is not None and float(theta) != float(top_theta):
        problems.append(f"rope_theta = {top_theta!r} and rope_parameters.rope_theta = {theta!r} disagree")
    theta = theta if theta is not None else top_theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(theta) if theta is not None else 10000.0}
    if rope_type not in _ROPE_KEYS:
        problems.append(f"rope type {rope_type!r} is not supported (titanlike has 'default' and 'llama3')")
        return out
    for key in sorted(set(rope) - _ROPE_KEYS[rope_type]):
        problems.append(f"rope {key} = {rope[key]!r} is not supported with rope_type {rope_type!r}")
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            problems.append(f"rope_type 'llama3' lacks {', '.join(missing)}")
            return out
        original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings"))
        out.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_seq_len=int(original) if original is not None else 8192,
        )
        if not out["rope_low_freq_factor"] < out["rope_high_freq_factor"]:
            problems.append(
                f"rope low_freq_factor {rope['low_freq_factor']} must be below high_freq_factor "
                f"{rope['high_freq_factor']}"
            )
    return out


def model_args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs of a Hugging Face Llama config.json's fields (either layout; the metadata set aside by
    ``titanlike.hf``). Raises ValueError with one line naming every field titanlike cannot honour, with its value."""
    problems: list[str] = []
    for key, (accepted, ours) in _FIXED_FIELDS.items():
        if key in config and config[key] not in accepted:
            problems.append(f"{key} = {config[key]!r} (titanlike has {ours})")
    honoured = {
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "rms_norm_eps",
        "max_position_embeddings",
        "head_dim",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        *_FIXED_FIELDS,
    }
    for key in sorted(set(config) - honoured - _IGNORED):
        problems.append(
            f"{key} = {config[key]!r} (a field titanlike's Llama does not know; remove it if it does not "
            f"change the model)"
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if k not in config
    ]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    rope = _rope_from_config(config, problems)
    args = None
    if not missing:
        try:
            dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            args = ModelArgs(
                dim=dim,
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                vocab_size=int(config["vocab_size"]),
                ffn_hidden_dim=int(config["intermediate_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                max_seq_len=int(config.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                **rope,
            )
        except (TypeError, ValueError) as e:
            problems.append(f"a value is not a number ({e})")
        if args is not None:
            if args.dim % args.n_heads or args.head_dim % 2:
                problems.append(
                    f"hidden_size {args.dim} / num_attention_heads {args.n_heads} is not an even integer head size"
                )
            elif config.get("head_dim") is not None and config["head_dim"] != args.head_dim:
                problems.append(
                    f"head_dim = {config['head_dim']} (titanlike has hidden_size / num_attention_heads "
                    f"= {args.head_dim})"
                )
            if args.n_heads % args.n_kv_heads:
                problems.append(
                    f"num_key_value_heads {args.n_kv_heads} does not divide num_attention_heads {args.n_heads}"
                )
    if problems:
        raise ValueError("; ".join(problems))
    return args


def describe(args: ModelArgs) -> str:
    """The architecture fields import takes from config.json, as one line."""
    rope = f"rope_theta {args.rope_theta:g}"
    if args.rope_scaling == "llama3":
        rope += (
            f", rope_scaling llama3 (factor {args.rope_scaling_factor:g}, low_freq_factor "
            f"{args.rope_low_freq_factor:g}, high_freq_factor {args.rope_high_freq_factor:g}, "
            f"original_max_seq_len {args.rope_original_max_seq_len})"
        )
    return (
        f"dim {args.dim}, n_layers {args.n_layers}, n_heads {args.n_heads}, n_kv_heads {args.n_kv_heads}, "
        f"ffn_hidden_dim {args.hidden_dim}, vocab_size {args.vocab_size}, tie_embeddings {args.tie_embeddings}, "
        f"{rope}, norm_eps {args.norm_eps:g}, max_seq_len {args.max_seq_len}"
    )


ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "hidden_dim",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "norm_eps",
)


def check_same_architecture(args: ModelArgs, ours: ModelArgs, source: str) -> None:
    """Raise ValueError when weights made for ``args`` would not mean the same in a model of ``ours``: besides the
    shapes (checked on load), the head split (the q/k permutation depends on it), RoPE and the norm epsilon."""
    diff = []
    for field in ARCH_FIELDS:
        a, b = getattr(args, field), getattr(ours, field)
        if (
            field.startswith("rope_")
            and field not in ("rope_theta", "rope_scaling")
            and "none" == args.rope_scaling == ours.rope_scaling
        ):
            continue
        if a != b:
            diff.append(f"{field} {a} there, {b} here")
    if diff:
        raise ValueError(f"{source} is for a different model: {'; '.join(diff)}")
