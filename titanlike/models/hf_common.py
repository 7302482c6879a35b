"""What every model's Hugging Face adapter may share, importable from the model folders (which may not import
``titanlike.hf``): the renaming of parameters between our FQNs and Hugging Face's by two tables. (The config.json
fields that change no weights are ``titanlike.hf.GENERIC_FIELDS``, set aside before an adapter reads the file.) And
the adapter protocol's ``describe`` / ``check_same_architecture`` for a model whose architecture is a list of args
fields; the config.json fields the Llama-style decoders (Llama, Qwen3) write alike; and the routed SwiGLU experts'
layouts (:class:`Experts`: ours one stacked tensor per weight, Hugging Face's one tensor per expert or transformers
5's fused in-memory pair), shared by the MoE adapters (Qwen3-MoE, Qwen3-Next, DeepSeek-V3)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["Experts", "Names", "check_same_fields", "decoder_hf_config", "describe_fields", "set_rope_and_dtype"]


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


class Experts:
    """The routed SwiGLU experts between our layout (``<prefix>.moe.experts.w1 / w3 / w2``, each (E, ...) stacked)
    and Hugging Face's, relative to a layer (``mlp.experts.<e>.gate_proj / up_proj / down_proj.weight``, or the
    fused ``mlp.experts.gate_up_proj`` (E, 2 I, H) = ``w1`` then ``w3`` on dim 1 and ``mlp.experts.down_proj`` =
    ``w2``). Import: :meth:`take` each layer tensor, then :meth:`stack_into` the output once (an expert missing from
    ``0 .. E-1`` is an error)."""

    HF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    _BACK = {v: k for k, v in HF.items()}
    _PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    _FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")

    def __init__(self):
        self._held: dict = {}  # (our prefix, w) -> {expert: tensor}

    @classmethod
    def hf_name(cls, hf_layer: str, w: str) -> str:
        """The per-expert name pattern of our stacked weight ``w`` under the Hugging Face layer prefix."""
        return f"{hf_layer}.mlp.experts.*.{cls.HF[w]}.weight"

    @classmethod
    def to_hf(cls, hf_layer: str, w: str, t) -> dict:
        """Our stacked weight ``w`` (E, ...) -> one new tensor per expert under the Hugging Face layer prefix."""
        return {f"{hf_layer}.mlp.experts.{e}.{cls.HF[w]}.weight": we.clone() for e, we in enumerate(t.unbind(0))}

    def take(self, rest: str, t, prefix: str, out: dict) -> bool:
        """``rest``: a Hugging Face name after its layer prefix; ``prefix``: our module of that layer
        (``layers.3``). True (and held, or written to ``out`` when fused) if it is an expert tensor."""
        if (m := self._PER_EXPERT.fullmatch(rest)) is not None:
            self._held.setdefault((prefix, self._BACK[m.group(2)]), {})[int(m.group(1))] = t
            return True
        if (m := self._FUSED.fullmatch(rest)) is not None:
            if m.group(1) == "down_proj":
                out[f"{prefix}.moe.experts.w2"] = t
            else:
                out[f"{prefix}.moe.experts.w1"], out[f"{prefix}.moe.experts.w3"] = t.chunk(2, dim=1)
            return True
        return False

    def stack_into(self, out: dict) -> None:
        for (prefix, w), by_expert in self._held.items():
            if sorted(by_expert) != list(range(len(by_expert))):
                raise ValueError(f"{prefix}.moe.experts: experts {sorted(by_expert)} are not 0..E-1")
            out[f"{prefix}.moe.experts.{w}"] = torch.stack([by_expert[e] for e in range(len(by_expert))])
