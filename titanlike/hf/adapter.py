"""The Hugging Face adapter protocol, and finding a model's adapter through the model registry.

Each model that interoperates with Hugging Face has an adapter module in its own folder
(``titanlike/models/<name>/hf.py``, named by its spec's ``hf_adapter``) that provides the members of
:class:`HFAdapter`. The model-independent parts (files, config.json metadata, the fit check of converted weights,
the messages) are this package's; the adapter knows only its own model's names, layouts and config fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from titanlike.models import get_spec, registered, spec_for

__all__ = [
    "GENERIC_FIELDS",
    "HFAdapter",
    "HFConfigError",
    "adapter_for",
    "adapter_for_config",
    "check_state_dict_fits",
    "expected_shapes",
]


@runtime_checkable
class HFAdapter(Protocol):
    """What a model's ``hf.py`` provides (module-level names; a module satisfies this protocol).

    Every function raises ValueError with one line on input it cannot convert; config.json problems are all named
    in that one line.
    """

    #: config.json's ``model_type`` this adapter reads and writes (import picks the adapter by it).
    MODEL_TYPE: str
    #: the transformers class of the exported checkpoint (config.json's ``architectures``).
    ARCHITECTURE: str

    def to_hf(self, state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Our full (plain-tensor) state dict -> Hugging Face names and layouts; new contiguous tensors; a tied
        output weight left out."""

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Hugging Face names and layouts -> our FQNs (a tied output weight named too); ValueError for a name the
        model has not. Whether the result is exactly the model's state dict is checked by the caller."""

    def hf_name(self, fqn: str) -> str:
        """The Hugging Face name of one of our FQNs (for messages)."""

    def shape_hint(self, fqn: str, got: tuple, want: tuple) -> str:
        """A sentence added to a shape mismatch of ``fqn`` ("" for none)."""

    def hf_config(self, args: Any, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
        """config.json for ``args`` in the layout of transformers ``layout`` (4 or 5)."""

    def model_args_from_hf_config(self, fields: dict) -> Any:
        """The args of config.json's ``fields`` (the file without :data:`GENERIC_FIELDS`, ``architectures``,
        ``model_type`` and ``quantization_config``, which the caller checks); ValueError naming every field it
        cannot honour, with its value, in one line."""

    def check_same_architecture(self, args: Any, ours: Any, source: str) -> None:
        """ValueError when weights made for ``args`` would not mean the same in a model of ``ours`` (both this
        model's args)."""

    def describe(self, args: Any) -> str:
        """The architecture fields import takes from config.json, as one line."""


_MEMBERS = (
    "MODEL_TYPE",
    "ARCHITECTURE",
    "to_hf",
    "from_hf",
    "hf_name",
    "shape_hint",
    "hf_config",
    "model_args_from_hf_config",
    "check_same_architecture",
    "describe",
)

# Fields of a config.json that do not change what the weights compute (metadata, generation and inference options,
# PretrainedConfig generics): taken out before the adapter reads the file, except those an adapter names in its
# optional READS_GENERIC (a hybrid model's layer_types: which layers are linear attention).
GENERIC_FIELDS = frozenset(
    {
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "_name_or_path",
        "name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "use_return_dict",
        "is_decoder",
        "is_encoder_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "cross_attention_hidden_size",
        "pruned_heads",
        "tf_legacy_loss",
        "use_bfloat16",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_commit_hash",
        "layer_types",
    }
)


class HFConfigError(ValueError):
    """A config.json titanlike cannot honour; the message lists every field at fault."""


def _checked(spec) -> HFAdapter:
    """The adapter module of ``spec``, refused in one line when it lacks a member of :class:`HFAdapter`."""
    if not spec.hf_adapter:
        raise ValueError(f"model '{spec.name}' has no Hugging Face adapter (ModelSpec.hf_adapter)")
    module = spec.hf()
    missing = [m for m in _MEMBERS if not hasattr(module, m)]
    if missing:
        raise TypeError(
            f"model '{spec.name}': its Hugging Face adapter {spec.hf_adapter} lacks {', '.join(missing)} "
            f"(see docs/adding_a_model.md)"
        )
    return module


def adapter_for(args) -> HFAdapter:
    """The Hugging Face adapter of the registered model ``args`` (a model, stage or args object) belongs to."""
    spec = spec_for(args)
    if spec is None:
        raise ValueError(f"{type(args).__name__} is not the model or args of a registered model (titanlike.models)")
    return _checked(spec)


def _adapters() -> dict[str, HFAdapter]:
    """config.json model_type -> the adapter of the registered model that reads it."""
    out: dict[str, HFAdapter] = {}
    for name in registered():
        spec = get_spec(name)
        if spec.hf_adapter:
            ad = _checked(spec)
            if getattr(ad, "ANY_MODEL_TYPE", False):  # reads any config.json, only for its own model's weights
                continue
            if ad.MODEL_TYPE in out:
                raise ValueError(f"two registered models read Hugging Face model_type '{ad.MODEL_TYPE}'")
            out[ad.MODEL_TYPE] = ad
    return out


def adapter_for_config(config: Mapping) -> tuple[HFAdapter | None, str | None]:
    """(the adapter of config.json's ``model_type``, None) or (None, the problem: no or an unknown model_type)."""
    adapters = _adapters()
    kind = config.get("model_type")
    if kind in adapters:
        return adapters[kind], None
    known = ", ".join(repr(k) for k in sorted(adapters))
    if kind is None:
        return None, f"no model_type (titanlike imports {known})"
    return None, f"model_type = {kind!r} (titanlike imports {known})"


def expected_shapes(args) -> dict[str, torch.Size]:
    """FQN -> shape of every entry of the full model's state dict (built on the meta device: no memory)."""
    return {k: v.shape for k, v in spec_for(args).build_meta(args).state_dict().items()}


def check_state_dict_fits(out: dict, args, adapter: HFAdapter) -> None:
    """Refuse a converted Hugging Face state dict whose names or shapes are not exactly those of the model of
    ``args`` (one ValueError naming the first missing / extra parameter or wrong shape, in Hugging Face names, with
    the adapter's hint)."""
    expected = expected_shapes(args)
    missing = [k for k in expected if k not in out]
    extra = [k for k in out if k not in expected]
    if missing or extra:
        what = (
            f"lacks {adapter.hf_name(missing[0])}"
            if missing
            else f"has {adapter.hf_name(extra[0])}, which this model has not"
        )
        raise ValueError(f"the Hugging Face weights do not fit the model ({args.n_layers} layers): the file {what}")
    for k, shape in expected.items():
        got = tuple(out[k].shape)
        if got != tuple(shape):
            raise ValueError(
                f"the Hugging Face weights do not fit the model: {adapter.hf_name(k)} has shape {got}, the "
                f"model needs {tuple(shape)}{adapter.shape_hint(k, got, tuple(shape))}"
            )
