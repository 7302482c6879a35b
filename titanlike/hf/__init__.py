"""Hugging Face interop for every registered model: safetensors files (one or sharded, with their index),
config.json, and the conversion of state dicts and architectures through each model's adapter.

* :mod:`~titanlike.hf.files`: the files, model-independent (safetensors, shards + index, config.json, atomic output
  folders, shard sizes);
* :mod:`~titanlike.hf.adapter`: the adapter protocol each model's ``titanlike/models/<name>/hf.py`` implements,
  found through the model registry (by args, or by config.json's ``model_type``), and the fit check of converted
  weights;
* :mod:`~titanlike.hf.convert`: to_hf / from_hf / hf_config / model_args_from_hf_config / save_hf / load_hf, the
  model-independent half of every conversion.

No file here names a model. See docs/checkpointing.md (Hugging Face) and docs/adding_a_model.md (what an adapter
provides).
"""

from titanlike.hf.adapter import (
    GENERIC_FIELDS,
    HFAdapter,
    HFConfigError,
    adapter_for,
    adapter_for_config,
    check_state_dict_fits,
    expected_shapes,
)
from titanlike.hf.convert import (
    check_same_architecture,
    describe_args,
    from_hf,
    hf_architecture,
    hf_config,
    load_hf,
    model_args_from_hf_config,
    save_hf,
    to_hf,
    transformers_major_version,
)
from titanlike.hf.files import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    WEIGHTS_NAME,
    parse_size,
    read_hf_config,
    read_safetensors,
    resolve_safetensors,
    resolve_weights,
    safetensors_shapes,
    write_hf_folder,
)

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "GENERIC_FIELDS",
    "HFAdapter",
    "HFConfigError",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "adapter_for",
    "adapter_for_config",
    "check_same_architecture",
    "check_state_dict_fits",
    "describe_args",
    "expected_shapes",
    "from_hf",
    "hf_architecture",
    "hf_config",
    "load_hf",
    "model_args_from_hf_config",
    "parse_size",
    "read_hf_config",
    "read_safetensors",
    "resolve_safetensors",
    "resolve_weights",
    "safetensors_shapes",
    "save_hf",
    "to_hf",
    "transformers_major_version",
    "write_hf_folder",
]
