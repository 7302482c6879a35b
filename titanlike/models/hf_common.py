"""What every model's Hugging Face adapter shares, importable from the model folders: the config.json fields of
``transformers``' ``PretrainedConfig`` that do not change what the weights compute (metadata, generation and
inference options, generics; an adapter honours its model's fields, ignores these, and refuses the rest), and the
renaming of parameters between our FQNs and Hugging Face's by two tables."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["METADATA_FIELDS", "Names"]


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


METADATA_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "pretraining_tp",
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
