"""Qwen3's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) for ``Qwen3ForCausalLM``: names and config.json
(no tensor transform: the model keeps Hugging Face's rotate-half RoPE layout, so q and k convert as they are).

Names (N = block index)::

    tok_embeddings.weight                      model.embed_tokens.weight
    layers.N.attention.wq/wk/wv/wo.weight      model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.N.attention.q_norm/k_norm.weight    model.layers.N.self_attn.q_norm/k_norm.weight
    layers.N.feed_forward.w1/w3/w2.weight      model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    layers.N.attention_norm.weight             model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight                   model.layers.N.post_attention_layernorm.weight
    norm.weight                                model.norm.weight
    output.weight                              lm_head.weight (left out when the embeddings are tied)

config.json: every field is honoured, is metadata that does not change what the weights compute (set aside by
``titanlike.hf`` before the adapter reads the file), or is refused (all at once, with its value): sliding-window
attention, attention biases, another activation or RoPE type.
"""

from __future__ import annotations

import torch

from titanlike.models.hf_common import Names, check_same_fields, decoder_hf_config, describe_fields, set_rope_and_dtype
from titanlike.models.qwen3.model import Qwen3Args

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_NAMES = Names("Qwen3", _TOP, _LAYER, "model.layers.")
hf_name, our_name = _NAMES.hf_name, _NAMES.our_name

_HONOURED = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "hidden_act",
        "attention_bias",
        "attention_dropout",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",  # read only with use_sliding_window, refused below
    }
)


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names; new contiguous tensors."""
    return {
        hf_name(fqn): t.detach().clone().contiguous()
        for fqn, t in state_dict.items()
        if not (fqn == "output.weight" and args.tie_embeddings)  # Qwen3ForCausalLM ties lm_head itself
    }


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen3 state dict -> our FQNs (with tied embeddings ``lm_head.weight`` is dropped and
    ``output.weight`` is the embedding); whether it is exactly the model's state dict is the caller's check."""
    out = {}
    for name, t in hf_state_dict.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # a tied head some exports still write: the embedding is the head
        out[our_name(name)] = t
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return ""


def hf_config(args: Qwen3Args, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``Qwen3ForCausalLM`` config.json for ``args`` in the layout of transformers ``layout`` (4 or 5): 5 has
    ``rope_parameters`` and ``dtype``, 4 a top-level ``rope_theta`` and ``torch_dtype``."""
    config = decoder_hf_config(
        ARCHITECTURE, MODEL_TYPE, args, bos_id, eos_id, use_sliding_window=False, sliding_window=None
    )
    rope = {"rope_theta": args.rope_theta, "rope_type": "default"}
    return set_rope_and_dtype(config, dtype, layout, args.rope_theta, rope)


def _rope_theta(config: dict, problems: list[str]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters = {rope!r} is not an object")
        return 10000.0
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        problems.append(f"rope type {kind!r} (titanlike's Qwen3 has the default RoPE)")
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
    if extra:
        problems.append(f"rope_parameters {', '.join(extra)} (titanlike's Qwen3 has no RoPE scaling)")
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return float(theta) if theta is not None else 10000.0


def model_args_from_hf_config(config: dict) -> Qwen3Args:
    """Qwen3Args of a Hugging Face Qwen3 config.json's fields (the metadata set aside by ``titanlike.hf``);
    ValueError naming every field titanlike cannot honour, in one line."""
    problems: list[str] = []
    for key, accepted in (("hidden_act", ("silu", "swish")), ("attention_bias", (False,))):
        if key in config and config[key] not in accepted:
            problems.append(f"{key} = {config[key]!r} (titanlike's Qwen3 has {accepted[0]!r})")
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        problems.append(f"attention_dropout = {config['attention_dropout']!r} (titanlike has no attention dropout)")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window = True (titanlike's Qwen3 attends over the whole sequence)")
    for key in sorted(set(config) - _HONOURED):
        problems.append(f"{key} = {config[key]!r} (a field titanlike's Qwen3 does not know)")
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if k not in config
    ]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    theta = _rope_theta(config, problems)
    args = None
    if not missing:
        try:
            n_heads = int(config["num_attention_heads"])
            args = Qwen3Args(
                dim=int(config["hidden_size"]),
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
                ffn_hidden_dim=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_seq_len=int(config.get("max_position_embeddings", 40960)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (TypeError, ValueError) as e:
            problems.append(f"a value is not a number ({e})")
    if problems:
        raise ValueError("; ".join(problems))
    return args


ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "hidden_dim",
    "vocab_size",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
)


def describe(args: Qwen3Args) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return describe_fields(args, (*ARCH_FIELDS, "max_seq_len"))


def check_same_architecture(args: Qwen3Args, ours: Qwen3Args, source: str) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours``."""
    check_same_fields(args, ours, source, ARCH_FIELDS)
