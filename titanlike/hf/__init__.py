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

# Each module's own __all__ is the package's: the names are listed once, where they are defined.
from titanlike.hf import adapter, convert, files
from titanlike.hf.adapter import *  # noqa: F403
from titanlike.hf.convert import *  # noqa: F403
from titanlike.hf.files import *  # noqa: F403

__all__ = [*adapter.__all__, *convert.__all__, *files.__all__]
