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
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from titanlike.models import ModelArgs

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

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
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
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
def hf_name(fqn: str) -> str:
    """The Hugging Face name of one of our parameter FQNs."""
    if fqn in _TOP_MAP:
        return _TOP_MAP[fqn]
    m = _OURS_LAYER.fullmatch(fqn)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise ValueError(f"no Hugging Face Llama name for parameter '{fqn}'")


def our_name(name: str) -> str:
    """Our FQN of a Hugging Face Llama parameter name."""
    if name in _HF_TO_OURS_TOP:
        return _HF_TO_OURS_TOP[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _HF_TO_OURS_LAYER:
        return f"layers.{m.group(1)}.{_HF_TO_OURS_LAYER[m.group(2)]}"
    raise ValueError(f"'{name}' is not a Hugging Face Llama parameter this model has")


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
    """A Hugging Face Llama state dict -> our FQNs (q/k rows un-permuted); checks the names are exactly a model's
    of ``args``. With tied embeddings ``output.weight`` is the embedding (our state dict lists both names)."""
    out = {}
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
    expected = expected_shapes(args)
    missing = [k for k in expected if k not in out]
    extra = [k for k in out if k not in expected]
    if missing or extra:
        what = f"lacks {hf_name(missing[0])}" if missing else f"has {hf_name(extra[0])}, which this model has not"
        raise ValueError(f"the Hugging Face weights do not fit the model ({args.n_layers} layers): the file {what}")
    for k, shape in expected.items():
        if tuple(out[k].shape) != tuple(shape):
            raise ValueError(f"the Hugging Face weights do not fit the model: {hf_name(k)} has shape "
                             f"{tuple(out[k].shape)}, the model needs {tuple(shape)}")
    return out


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """FQN -> shape of every entry of the full model's state dict (built on the meta device: no memory)."""
    from titanlike.models import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return {k: v.shape for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ config.json
def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """A ``LlamaForCausalLM`` config.json for ``args``."""
    return {
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
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs of a Hugging Face Llama config.json; raises ValueError naming what this model cannot represent."""
    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json: model_type '{config.get('model_type')}' is not 'llama'")
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        args = ModelArgs(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
                         n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                         vocab_size=int(config["vocab_size"]), ffn_hidden_dim=int(config["intermediate_size"]),
                         norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         rope_theta=float(config.get("rope_theta", 10000.0)),
                         max_seq_len=int(config.get("max_position_embeddings", 2048)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]}") from None
    unsupported = {"rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, ours in unsupported.items():
        if config.get(key, ours) != ours:
            raise ValueError(f"config.json: {key} = {config[key]!r} is not supported (this model has {ours!r})")
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ValueError(f"config.json: head_dim {config['head_dim']} != hidden_size / num_attention_heads "
                         f"{args.head_dim}, which this model assumes")
    return args


def check_same_architecture(args: ModelArgs, ours: ModelArgs, source: str) -> None:
    """Raise ValueError when weights made for ``args`` would not mean the same in a model of ``ours``: besides the
    shapes (checked on load), the head split (the q/k permutation depends on it), RoPE base and norm epsilon."""
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "rope_theta",
                  "tie_embeddings"):
        a, b = getattr(args, field), getattr(ours, field)
        if a != b:
            raise ValueError(f"{source} is for a different model: {field} {a} there, {b} here")


# ------------------------------------------------------------------------------------------------ files
def _atomic_folder(out_dir: Path):
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    return tmp


def save_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/model.safetensors`` (HF names, permuted q/k) and ``out_dir/config.json``.

    Written into a temporary sibling folder and renamed into place; an existing ``out_dir`` is never touched.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = to_hf(state_dict, args)
    dtype = next(iter(tensors.values())).dtype
    tmp = _atomic_folder(out_dir)
    save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    (tmp / CONFIG_NAME).write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    os.rename(tmp, out_dir)
    return out_dir


def resolve_safetensors(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a .safetensors file, else ``path/model.safetensors``; FileNotFoundError if absent."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_NAME
    if not p.is_file() or p.suffix != ".safetensors":
        raise FileNotFoundError(f"'{path}' is not a .safetensors file or a folder holding {WEIGHTS_NAME}")
    return p


def read_hf_config(weights: Path) -> dict | None:
    """The config.json beside a safetensors file, or None."""
    cfg = weights.with_name(CONFIG_NAME)
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"'{cfg}' is not valid JSON: {e}") from None


def safetensors_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in a safetensors file, from its header (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"'{weights}' is not a readable safetensors file ({e})") from None


def load_hf(path: str | os.PathLike, args: ModelArgs | None = None) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Read a Hugging Face Llama safetensors file (or a folder with model.safetensors and config.json) into our
    FQNs. ``args`` (the model to load into) is needed when there is no config.json beside the file; when both
    exist they must describe the same architecture. Returns (state dict, the weights' ModelArgs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = resolve_safetensors(path)
    config = read_hf_config(weights)
    file_args = model_args_from_hf_config(config) if config is not None else None
    if file_args is not None and args is not None:
        check_same_architecture(file_args, args, f"'{weights}'")
    use = args if args is not None else file_args
    if use is None:
        raise ValueError(f"'{weights}' has no {CONFIG_NAME} beside it to say the model's shape")
    try:
        hf_sd = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"'{weights}' is not a readable safetensors file ({e})") from None
    return from_hf(hf_sd, use), use
