"""Hugging Face Llama interop: our state dict <-> ``LlamaForCausalLM`` names, config.json, safetensors files.

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

**config.json.** Import takes the architecture from it (:func:`model_args_from_hf_config`): every field either maps
to a ModelArgs field, is metadata that does not change the model (``IGNORED_FIELDS``), or is refused with one line
naming the field and its value (all such fields at once). Both layouts are read: transformers 4's top-level
``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``. Export writes the layout of the
installed transformers (5 when it is absent), which both versions load.

**Files.** ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` listed by
``model.safetensors.index.json`` (what ``save_pretrained`` writes above its shard size); float32, bfloat16 or
float16 tensors.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from titanlike.models import ModelArgs
from titanlike.models.hf_common import METADATA_FIELDS
from titanlike.models.spec import check_state_dict_fits

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes, as transformers 4 ("5GB")

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
def _adapter(args):
    """The Hugging Face adapter of another registered model (its spec's ``hf_adapter``, e.g. GPT-2's
    titanlike/models/gpt2/hf.py), or None for Llama (this module)."""
    from titanlike.models import spec_for

    spec = spec_for(args)
    if spec is None or spec.hf_adapter in ("", __name__):
        return None
    return spec.hf()


def _adapter_of_config(config):
    """The adapter of the registered model whose ``hf_model_type`` is config.json's ``model_type`` (not Llama)."""
    from titanlike.models import get_spec, registered

    kind = config.get("model_type", "llama") if isinstance(config, dict) else "llama"
    for name in registered():
        spec = get_spec(name)
        if spec.hf_model_type == kind and spec.hf_adapter not in ("", __name__):
            return spec.hf()
    return None


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
    if (ad := _adapter(args)) is not None:
        return ad.to_hf(state_dict, args)
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
    """A Hugging Face Llama state dict -> our FQNs (q/k rows un-permuted); checks the names are exactly a model's
    of ``args``. With tied embeddings ``output.weight`` is the embedding (our state dict lists both names)."""
    if (ad := _adapter(args)) is not None:
        return ad.from_hf(hf_state_dict, args)
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
    check_state_dict_fits(out, args, hf_name, hint=_vocab_hint)
    return out


def _vocab_hint(fqn: str, got: tuple, want: tuple) -> str:
    if fqn in ("tok_embeddings.weight", "output.weight") and got[1:] == want[1:]:
        return (
            f"; the vocabulary differs ({got[0]} vs {want[0]}): give the folder with its config.json (the "
            f"architecture is then taken from it), or set model.vocab_multiple 1 and a tokenizer of that size"
        )
    return ""


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """FQN -> shape of every entry of the full model's state dict (built on the meta device: no memory)."""
    from titanlike.models import spec_for

    return {k: v.shape for k, v in spec_for(args).build_meta(args).state_dict().items()}


# ------------------------------------------------------------------------------------------------ config.json
# Fields of a Llama config.json that do not change what the weights compute (metadata, generation and inference
# options, PretrainedConfig generics, shared by every adapter); everything else is either honoured or refused.
IGNORED_FIELDS = METADATA_FIELDS
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


class HFConfigError(ValueError):
    """A config.json titanlike cannot honour; the message lists every field at fault."""


def transformers_major_version() -> int | None:
    """The installed transformers' major version (without importing it), or None."""
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


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


def hf_config(
    args: ModelArgs,
    dtype: torch.dtype = torch.float32,
    bos_id: int | None = None,
    eos_id: int | None = None,
    layout: int | None = None,
) -> dict:
    """A ``LlamaForCausalLM`` config.json for ``args``, in the layout of transformers ``layout`` (4 or 5; default:
    the installed version, 5 when it is absent): 5 has ``rope_parameters`` and ``dtype``, 4 top-level
    ``rope_theta`` / ``rope_scaling`` and ``torch_dtype``. Both load in both versions. Another registered model's
    args get its adapter's config (GPT-2: ``GPT2LMHeadModel``)."""
    if (ad := _adapter(args)) is not None:
        return ad.hf_config(args, dtype, bos_id=bos_id, eos_id=eos_id)
    layout = layout or transformers_major_version() or 5
    layout = 5 if layout >= 5 else 4
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if layout >= 5:
        config["rope_parameters"] = _rope_dict(args, 5)
        config["dtype"] = str(dtype).removeprefix("torch.")
    else:
        config["rope_theta"] = args.rope_theta
        config["rope_scaling"] = _rope_dict(args, 4)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


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


def model_args_from_hf_config(config: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs of a Hugging Face Llama config.json (either layout). Raises :class:`HFConfigError` with one line
    naming every field titanlike cannot honour, with its value."""
    if not isinstance(config, dict):
        raise HFConfigError(f"{source} is not a JSON object")
    if (ad := _adapter_of_config(config)) is not None:  # another registered model's config.json (model_type gpt2)
        try:
            return ad.model_args_from_hf_config(config)
        except ValueError as e:
            raise HFConfigError(f"{source}: {e}") from None
    problems: list[str] = []
    if config.get("model_type", "llama") != "llama":
        problems.append(f"model_type = {config.get('model_type')!r} (titanlike imports 'llama')")
    arch = config.get("architectures")
    if arch not in (None, ["LlamaForCausalLM"]):
        problems.append(f"architectures = {arch!r} (titanlike imports ['LlamaForCausalLM'])")
    for key, (accepted, ours) in _FIXED_FIELDS.items():
        if key in config and config[key] not in accepted:
            problems.append(f"{key} = {config[key]!r} (titanlike has {ours})")
    if config.get("quantization_config") is not None:
        problems.append(
            f"quantization_config = {config['quantization_config']!r} (quantized weights are not "
            f"supported; give a float32/bfloat16/float16 checkpoint)"
        )
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
        "quantization_config",
        *_FIXED_FIELDS,
    }
    for key in sorted(set(config) - honoured - IGNORED_FIELDS):
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
        raise HFConfigError(f"{source}: titanlike cannot honour " + "; ".join(problems))
    return args


def describe_args(args: ModelArgs) -> str:
    """The architecture fields import takes from config.json, as one line."""
    if _adapter(args) is not None:
        return ", ".join(f"{k} {v}" for k, v in vars(args).items())
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
    if type(args) is not type(ours):
        from titanlike.models import spec_for

        there, here = spec_for(args), spec_for(ours)
        raise ValueError(
            f"{source} is for a different model: {there.name if there else type(args).__name__} there, "
            f"{here.name if here else type(ours).__name__} here (model.name)"
        )
    if (ad := _adapter(args)) is not None:
        return ad.check_same_architecture(args, ours, source)
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


# ------------------------------------------------------------------------------------------------ files
def _atomic_folder(out_dir: Path):
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    return tmp


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` / ``500MiB`` / ``100KB`` / an integer (transformers' max_shard_size spelling)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max shard size {size!r} is not a size like 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    layout: int | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` (HF names, permuted q/k) and ``out_dir/config.json``; above
    ``max_shard_size`` bytes, shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, as
    ``save_pretrained`` does. ``dtype``: cast the weights (default: keep). ``bos_id`` / ``eos_id``: the tokenizer's.

    Written into a temporary sibling folder and renamed into place; an existing ``out_dir`` is never touched.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    limit = parse_size(max_shard_size)
    tensors = to_hf(state_dict, args)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    dtype = next(iter(tensors.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    tmp = _atomic_folder(out_dir)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config(args, dtype, bos_id=bos_id, eos_id=eos_id, layout=layout)
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    os.rename(tmp, out_dir)
    return out_dir


def resolve_weights(path: str | os.PathLike) -> tuple[list[Path], Path]:
    """The safetensors files of a Hugging Face checkpoint and the folder holding its config.json.

    ``path`` is a folder (with ``model.safetensors`` or ``model.safetensors.index.json``), a ``.safetensors`` file
    or an index file. FileNotFoundError / ValueError (one line) for anything else, a missing shard included.
    """
    p = Path(path)
    if p.is_dir():
        if (p / INDEX_NAME).is_file():
            p = p / INDEX_NAME
        elif (p / WEIGHTS_NAME).is_file():
            p = p / WEIGHTS_NAME
    if p.is_file() and p.name.endswith(".safetensors.index.json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"'{p}' is not a safetensors index (no weight_map: {e!r})") from None
        missing = [f for f in files if not (p.parent / f).is_file()]
        if missing:
            raise ValueError(f"'{p}' lists shards that are not there: {', '.join(missing)}")
        return [p.parent / f for f in files], p.parent
    if not p.is_file() or p.suffix != ".safetensors":
        raise FileNotFoundError(
            f"'{path}' is not a .safetensors file or a folder holding {WEIGHTS_NAME} or {INDEX_NAME}"
        )
    return [p], p.parent


def resolve_safetensors(path: str | os.PathLike) -> Path:
    """The single safetensors file (or index) of ``path``; kept for callers that name one file."""
    files, _ = resolve_weights(path)
    return files[0]


def read_hf_config(folder: Path) -> dict | None:
    """The config.json in ``folder`` (or beside a file given instead), or None."""
    folder = Path(folder)
    cfg = (folder if folder.is_dir() else folder.parent) / CONFIG_NAME
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"'{cfg}' is not valid JSON: {e}") from None


def hf_architecture(path: str | os.PathLike) -> ModelArgs | None:
    """The architecture of a Hugging Face checkpoint at ``path`` (folder, file or index) from its config.json;
    None when ``path`` is not one (a DCP folder, nothing there) or has no config.json. HFConfigError / ValueError
    for a config.json titanlike cannot honour."""
    p = Path(path)
    if not p.exists() or (p.is_dir() and (p / ".metadata").is_file()):
        return None
    try:
        _, folder = resolve_weights(p)
    except FileNotFoundError:
        return None
    config = read_hf_config(folder)
    if config is None:
        return None
    return model_args_from_hf_config(config, str(folder / CONFIG_NAME))


def safetensors_shapes(weights: Path | list[Path]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the safetensors file(s), from their headers (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for w in [weights] if isinstance(weights, Path) else weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                for k in f.keys():
                    if k in out:
                        raise ValueError(f"'{k}' is in more than one shard ('{w}' and another)")
                    out[k] = tuple(f.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"'{w}' is not a readable safetensors file ({e})") from None
    return out


def load_hf(
    path: str | os.PathLike, args: ModelArgs | None = None, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Read a Hugging Face Llama checkpoint (a folder with config.json and model.safetensors or shards, or one
    .safetensors file) into our FQNs, tensors cast to ``dtype`` if given. ``args`` (the model to load into) is needed
    when there is no config.json; when both exist they must describe the same architecture. Returns (state dict,
    the weights' ModelArgs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files, folder = resolve_weights(path)
    config = read_hf_config(folder)
    file_args = model_args_from_hf_config(config, str(folder / CONFIG_NAME)) if config is not None else None
    if file_args is not None and args is not None:
        check_same_architecture(file_args, args, f"'{path}'")
    use = args if args is not None else file_args
    if use is None:
        raise ValueError(f"'{path}' has no {CONFIG_NAME} beside it to say the model's shape")
    hf_sd = {}
    for w in files:
        try:
            part = load_file(str(w))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"'{w}' is not a readable safetensors file ({e})") from None
        hf_sd.update({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in part.items()})
    return from_hf(hf_sd, use), use
