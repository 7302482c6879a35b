"""GPT-2's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`): ``GPT2LMHeadModel`` names, Conv1D transposes,
config.json.

Names (N = block index)::

    tok_embeddings.weight            transformer.wte.weight
    pos_embeddings.weight            transformer.wpe.weight
    layers.N.ln_1.weight / .bias     transformer.h.N.ln_1.weight / .bias          (same for ln_2)
    layers.N.attn.c_attn.weight      transformer.h.N.attn.c_attn.weight           transposed (Conv1D: in x out)
    layers.N.attn.c_proj.weight      transformer.h.N.attn.c_proj.weight           transposed
    layers.N.mlp.c_fc.weight         transformer.h.N.mlp.c_fc.weight              transposed
    layers.N.mlp.c_proj.weight       transformer.h.N.mlp.c_proj.weight            transposed
    (their biases keep their names and shapes)
    norm.weight / .bias              transformer.ln_f.weight / .bias
    output.weight                    lm_head.weight (left out when the embeddings are tied)

Hugging Face's Conv1D computes ``x @ W + b`` with ``W`` of shape (in, out); our ``nn.Linear`` stores (out, in).
The fused ``c_attn`` keeps the q | k | v order on both sides. Buffers old exports carry (``attn.bias``,
``attn.masked_bias``: the causal mask) are ignored on import.
"""

from __future__ import annotations

import re

import torch

from titanlike.models.gpt2.model import GPT2Args
from titanlike.models.hf_common import Names

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_TOP = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_LAYER_SUFFIXES = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)
_HF_IGNORED = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")


_NAMES = Names("GPT-2", _TOP, _LAYER_SUFFIXES, "transformer.h.")
hf_name, our_name = _NAMES.hf_name, _NAMES.our_name


def to_hf(state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names, Conv1D weights transposed; new contiguous tensors."""
    out = {}
    for fqn, t in state_dict.items():
        if fqn == "output.weight" and args.tie_embeddings:
            continue  # GPT2LMHeadModel ties lm_head to wte itself
        if fqn.endswith(_TRANSPOSED):
            t = t.t()
        out[hf_name(fqn)] = t.detach().clone().contiguous()
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 state dict -> our FQNs (Conv1D weights transposed back); the causal-mask buffers and,
    with tied embeddings, ``lm_head.weight`` are dropped (``output.weight`` is the embedding)."""
    out = {}
    for name, t in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name) or (name == "lm_head.weight" and args.tie_embeddings):
            continue
        fqn = our_name(name)
        out[fqn] = t.t() if fqn.endswith(_TRANSPOSED) and t.ndim == 2 else t
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return " (transposed for Conv1D)"


def hf_config(args: GPT2Args, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``GPT2LMHeadModel`` config.json for ``args`` (dropout 0: the same function as our model). Both
    transformers layouts read this one (``torch_dtype``; GPT-2 has no RoPE fields), so ``layout`` changes nothing."""
    ids = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
    return {
        **ids,
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": args.vocab_size,
        "n_positions": args.max_seq_len,
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": args.hidden_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# Fields whose value must be the one this model implements: field -> its value (the default when absent).
_FIXED_FIELDS = {
    "activation_function": "gelu_new",
    "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True,
}


def model_args_from_hf_config(config: dict) -> GPT2Args:
    """GPT2Args of a Hugging Face GPT-2 config.json's fields (the metadata set aside by ``titanlike.hf``); ValueError
    naming every field it cannot honour, in one line."""
    problems = [
        f"{key} = {config[key]!r} (titanlike's GPT-2 has {ours!r})"
        for key, ours in _FIXED_FIELDS.items()
        if config.get(key, ours) != ours
    ]
    missing = [k for k in ("n_embd", "n_layer", "n_head", "vocab_size") if k not in config]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    args = None
    if not missing:
        try:
            dim = int(config["n_embd"])
            inner = int(config.get("n_inner") or 4 * dim)
            args = GPT2Args(
                dim=dim,
                n_layers=int(config["n_layer"]),
                n_heads=int(config["n_head"]),
                vocab_size=int(config["vocab_size"]),
                ffn_hidden_dim=None if inner == 4 * dim else inner,
                norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                max_seq_len=int(config.get("n_positions", 1024)),
                tie_embeddings=bool(config.get("tie_word_embeddings", True)),
            )
        except (TypeError, ValueError) as e:
            problems.append(f"a value is not a number ({e})")
    if problems:
        raise ValueError("; ".join(problems))
    return args


def describe(args: GPT2Args) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return ", ".join(f"{k} {v}" for k, v in vars(args).items())


def check_same_architecture(args: GPT2Args, ours: GPT2Args, source: str) -> None:
    """Raise ValueError when weights made for ``args`` would not mean the same in a model of ``ours``."""
    for field in (
        "dim",
        "n_layers",
        "n_heads",
        "vocab_size",
        "hidden_dim",
        "max_seq_len",
        "norm_eps",
        "tie_embeddings",
    ):
        a, b = getattr(args, field), getattr(ours, field)
        if a != b:
            raise ValueError(f"{source} is for a different model: {field} {a} there, {b} here")
