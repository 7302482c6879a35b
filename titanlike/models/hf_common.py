"""What every model's Hugging Face adapter may share, importable from the model folders (which may not import
``titanlike.hf``): the renaming of parameters between our FQNs and Hugging Face's by two tables. (The config.json
fields that change no weights are ``titanlike.hf.GENERIC_FIELDS``, set aside before an adapter reads the file.) And
the adapter protocol's ``describe`` / ``check_same_architecture`` for a model whose architecture is a list of args
fields; and the config.json fields the Llama-style decoders (Llama, Qwen3) write alike."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["Names", "check_same_fields", "decoder_hf_config", "describe_fields", "set_rope_and_dtype"]


class Names:
    """Our FQN <-> a Hugging Face name: ``top`` maps whole names (``norm.weight`` -> ``model.norm.weight``),
    ``per_layer`` the part after ``layers.N.`` (a mapping, or names that are the same on both sides), which Hugging
    Face puts after ``hf_layers`` + ``N.`` (``"model.layers."``, GPT-2's ``"transformer.h."``). ``model`` names it in
    errors."""

    def __init__(
        self, model: str, top: Mapping[str, str], per_layer: Mapping[str, str] | Iterable[str], hf_layers: str
    ):
        self.model, self.hf_layers = model, hf_layers
        self.top = dict(top)
        self.per_layer = dict(per_layer) if isinstance(per_layer, Mapping) else {n: n for n in per_layer}
        self._top_back = {v: k for k, v in self.top.items()}
        self._layer_back = {v: k for k, v in self.per_layer.items()}
        self._ours = re.compile(r"layers\.(\d+)\.(.+)")
        self._theirs = re.compile(re.escape(hf_layers) + r"(\d+)\.(.+)")

    def hf_name(self, fqn: str) -> str:
        if fqn in self.top:
            return self.top[fqn]
        m = self._ours.fullmatch(fqn)
        if m and m.group(2) in self.per_layer:
            return f"{self.hf_layers}{m.group(1)}.{self.per_layer[m.group(2)]}"
        raise ValueError(f"no Hugging Face {self.model} name for parameter '{fqn}'")

    def our_name(self, name: str) -> str:
        if name in self._top_back:
            return self._top_back[name]
        m = self._theirs.fullmatch(name)
        if m and m.group(2) in self._layer_back:
            return f"layers.{m.group(1)}.{self._layer_back[m.group(2)]}"
        raise ValueError(f"'{name}' is not a Hugging Face {self.model} parameter this model has")


def describe_fields(args, fields: Iterable[str]) -> str:
    """The architecture fields import takes from config.json, as one line (``describe`` of the adapter protocol)."""
    return ", ".join(f"{f} {getattr(args, f)}" for f in fields)


def check_same_fields(args, ours, source: str, fields: Iterable[str]) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours``: every field of
    ``fields`` that differs, in one line (``check_same_architecture`` of the adapter protocol)."""
    diff = [
        f"{f} {getattr(args, f)} there, {getattr(ours, f)} here" for f in fields if getattr(args, f) != getattr(ours, f)
    ]
    if diff:
        raise ValueError(f"{source} is for a different model: {'; '.join(diff)}")


def decoder_hf_config(architecture: str, model_type: str, args, bos_id: int | None, eos_id: int | None, **own) -> dict:
    """The config.json of a Llama-style decoder (RMSNorm, SiLU-gated MLP, bias-free attention): the sizes of
    ``args``, then the model's ``own`` fields, then the fields both transformers layouts share."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
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
        **own,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def set_rope_and_dtype(config: dict, dtype, layout: int, rope_theta: float, rope_parameters: dict, **layout4):
    """The RoPE and dtype fields in the layout of transformers ``layout``: 5 has ``rope_parameters`` and ``dtype``,
    4 a top-level ``rope_theta`` (and the model's ``layout4`` fields, Llama's ``rope_scaling``) and ``torch_dtype``;
    returns ``config``."""
    name = str(dtype).removeprefix("torch.")
    if layout >= 5:
        config["rope_parameters"] = rope_parameters
        config["dtype"] = name
    else:
        config["rope_theta"] = rope_theta
        config.update(layout4)
        config["torch_dtype"] = name
    return config
