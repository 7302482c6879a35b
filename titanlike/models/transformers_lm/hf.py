"""The Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) of a transformers model trained directly
(``model.name = "hf"``): the model *is* the library's, so the names are its own ``save_pretrained`` names and
config.json is its own.

Names: the wrapper's FQNs with the base model's prefix (``base_model_prefix``, ``model`` for every Llama-like
family) in front of everything but the head::

    embed_tokens.weight        model.embed_tokens.weight
    layers.N.<rest>            model.layers.N.<rest>
    norm.weight                model.norm.weight
    lm_head.weight             lm_head.weight (left out when the embeddings are tied)

It reads any ``model_type`` (``ANY_MODEL_TYPE``): ``titanlike.hf`` hands it the whole config.json when the weights
are for a model of this kind (``checkpoint.initial_load_path`` with ``model.name = "hf"``) and never picks it by
``model_type`` (a ``qwen3`` folder without ``model.name`` stays titanlike's Qwen3).
"""

from __future__ import annotations

import torch

from titanlike.models.transformers_lm.model import HFArgs, config_problems, meta_model

MODEL_TYPE = "transformers"  # not a config.json model_type: this adapter reads any (ANY_MODEL_TYPE)
ARCHITECTURE = "AutoModelForCausalLM"  # the file's own architectures are written and checked
ANY_MODEL_TYPE = True

# config.json fields that do not change what the weights compute (written by save_pretrained, generation options)
_METADATA = frozenset(
    {
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def _prefix(args: HFArgs) -> str:
    return meta_model(args).base_model_prefix


def hf_name(fqn: str, args: HFArgs | None = None) -> str:
    if fqn.startswith("lm_head."):
        return fqn
    return f"{_prefix(args) if args is not None else 'model'}.{fqn}"


def _our_name(name: str, prefix: str) -> str:
    if name.startswith("lm_head."):
        return name
    if name.startswith(prefix + "."):
        return name[len(prefix) + 1 :]
    raise ValueError(f"'{name}' is not a parameter name of this transformers model (no '{prefix}.' prefix)")


def to_hf(state_dict: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> the model's ``save_pretrained`` names; new contiguous tensors."""
    prefix = _prefix(args)
    return {
        (fqn if fqn.startswith("lm_head.") else f"{prefix}.{fqn}"): t.detach().clone().contiguous()
        for fqn, t in state_dict.items()
        if not (fqn == "lm_head.weight" and args.tie_embeddings)
    }


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """The model's ``save_pretrained`` names -> our FQNs (a tied head is the embedding)."""
    prefix = _prefix(args)
    out = {}
    for name, t in hf_state_dict.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        out[_our_name(name, prefix)] = t
    if args.tie_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return ""


def hf_config(args: HFArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """The model's own config.json (the installed transformers' layout: it is the file the model was built from),
    with the weights' dtype, the architecture transformers built and the tokenizer's ids when given."""
    config = dict(args.config)
    config["architectures"] = [type_name(args)]
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def type_name(args: HFArgs) -> str:
    """The transformers class ``AutoModelForCausalLM`` builds for ``args``."""
    from transformers import AutoModelForCausalLM

    from titanlike.models.transformers_lm.model import hf_config_object

    cfg = hf_config_object(args.config)
    return AutoModelForCausalLM._model_mapping[type(cfg)].__name__


def model_args_from_hf_config(fields: dict) -> HFArgs:
    """The args of a whole config.json; ValueError naming every problem in one line."""
    problems = config_problems(fields)
    if problems:
        raise ValueError("; ".join(problems))
    return HFArgs(config=dict(fields))


def _architecture(args: HFArgs) -> dict:
    return {k: v for k, v in args.config.items() if k not in _METADATA}


def check_same_architecture(args: HFArgs, ours: HFArgs, source: str) -> None:
    """ValueError when weights made for ``args`` (a config.json) would not mean the same in ``ours``: any field
    but metadata differs."""
    a, b = _architecture(args), _architecture(ours)
    diff = [f"{k} {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        raise ValueError(f"{source} is for a different model: {'; '.join(diff)}")


def describe(args: HFArgs) -> str:
    return (
        f"{args.model_type}: dim {args.dim}, n_layers {args.n_layers}, n_heads {args.n_heads}, n_kv_heads "
        f"{args.n_kv_heads}, head_dim {args.head_dim}, hidden_dim {args.hidden_dim}, vocab_size {args.vocab_size}, "
        f"tie_embeddings {args.tie_embeddings}"
    )
