"""Our checkpoints <-> Hugging Face ones, for every registered model: each call finds the model's adapter
(:mod:`titanlike.hf.adapter`) and does the model-independent rest (config.json metadata, the transformers layout,
the fit check, the files).

**config.json.** Import takes the architecture from it (:func:`model_args_from_hf_config`): ``model_type`` picks
the registered model's adapter; ``architectures`` must be that adapter's class; metadata that does not change the
model (:data:`~titanlike.hf.adapter.GENERIC_FIELDS`) is set aside; quantized checkpoints are refused; every other
field either maps to a field of the model's args or is refused by the adapter, with its value, all such fields in
one line. Export writes the layout of the installed transformers (5 when it is absent), which both versions load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from titanlike.hf.adapter import (
    GENERIC_FIELDS,
    HFConfigError,
    adapter_for,
    adapter_for_config,
    check_state_dict_fits,
)
from titanlike.hf.files import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    read_hf_config,
    read_safetensors,
    resolve_weights,
    safetensors_shapes,
    write_hf_folder,
)
from titanlike.models import spec_for

__all__ = [
    "check_same_architecture",
    "describe_args",
    "from_hf",
    "hf_architecture",
    "hf_config",
    "load_hf",
    "model_args_from_hf_config",
    "save_hf",
    "to_hf",
    "transformers_major_version",
]


def transformers_major_version() -> int | None:
    """The installed transformers' major version (without importing it), or None."""
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def to_hf(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names and layouts (the model's adapter); new tensors."""
    return adapter_for(args).to_hf(state_dict, args)


def from_hf(hf_state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> our FQNs (the model's adapter), checked to be exactly the state dict of the
    model of ``args``: names and shapes (one ValueError in Hugging Face names). With tied embeddings the output
    weight is the embedding (our state dict lists both names)."""
    ad = adapter_for(args)
    out = ad.from_hf(hf_state_dict, args)
    check_state_dict_fits(out, args, ad)
    return out


def hf_config(
    args,
    dtype: torch.dtype = torch.float32,
    bos_id: int | None = None,
    eos_id: int | None = None,
    layout: int | None = None,
) -> dict:
    """The config.json of ``args`` (the model's adapter, for its transformers class) in the layout of transformers
    ``layout`` (4 or 5; default: the installed version, 5 when it is absent). Both layouts load in both versions."""
    layout = layout or transformers_major_version() or 5
    return adapter_for(args).hf_config(args, dtype, bos_id, eos_id, 5 if layout >= 5 else 4)


def model_args_from_hf_config(config: dict, source: str = "config.json", like=None, weight_names=None):
    """The model args of a Hugging Face config.json (either layout), of the registered model its ``model_type``
    names. Raises :class:`HFConfigError` with one line naming every field titanlike cannot honour, with its value.

    ``like``: the args of the model the weights are for; when its adapter reads any config.json itself
    (``ANY_MODEL_TYPE``: a transformers model trained directly, ``model.name = "hf"``), that adapter reads the
    whole file."""
    if not isinstance(config, dict):
        raise HFConfigError(f"{source} is not a JSON object")
    own = adapter_for(like) if like is not None else None
    if own is not None and getattr(own, "ANY_MODEL_TYPE", False):
        try:
            return own.model_args_from_hf_config(dict(config))
        except ValueError as e:
            raise HFConfigError(f"{source}: titanlike cannot honour {e}") from None
    ad, problem = adapter_for_config(config)
    problems = [problem] if problem else []
    arch = config.get("architectures")
    if ad is not None and arch not in (None, [ad.ARCHITECTURE]):
        problems.append(f"architectures = {arch!r} (titanlike imports [{ad.ARCHITECTURE!r}])")
    quant = config.get("quantization_config")
    accepted = getattr(ad, "QUANTIZATION_METHODS", ()) if ad is not None else ()
    if quant is not None and not (isinstance(quant, dict) and quant.get("quant_method") in accepted):
        problems.append(
            f"quantization_config = {config['quantization_config']!r} (quantized weights are not "
            f"supported; give a float32/bfloat16/float16 checkpoint)"
        )
    args = None
    if ad is not None:
        fields = {
            k: v
            for k, v in config.items()
            if (k not in GENERIC_FIELDS or k in getattr(ad, "READS_GENERIC", ()))
            and k not in ("architectures", "model_type", "quantization_config")
        }
        try:
            args = ad.model_args_from_hf_config(fields)
            if weight_names is not None and hasattr(ad, "args_for_weights"):
                # optional adapter member: the args of the weights the files hold (DeepSeek-V3: its MTP depths)
                args = ad.args_for_weights(args, weight_names)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise HFConfigError(f"{source}: titanlike cannot honour " + "; ".join(problems))
    return args


def describe_args(args) -> str:
    """The architecture fields import takes from config.json, as one line (the model's adapter)."""
    return adapter_for(args).describe(args)


def check_same_architecture(args, ours, source: str) -> None:
    """Raise ValueError when weights made for ``args`` would not mean the same in a model of ``ours``: another
    model, or (the model's adapter) the same model with different shapes or numerics."""
    if type(args) is not type(ours):
        there, here = spec_for(args), spec_for(ours)
        raise ValueError(
            f"{source} is for a different model: {there.name if there else type(args).__name__} there, "
            f"{here.name if here else type(ours).__name__} here (model.name)"
        )
    adapter_for(args).check_same_architecture(args, ours, source)


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args,
    out_dir: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    layout: int | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` (Hugging Face names and layouts) and ``out_dir/config.json``; above
    ``max_shard_size`` bytes, shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, as
    ``save_pretrained`` does. ``dtype``: cast the weights (default: keep). ``bos_id`` / ``eos_id``: the tokenizer's.

    Written into a temporary sibling folder and renamed into place; an existing ``out_dir`` is never touched.
    """
    tensors = to_hf(state_dict, args)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    dtype = next(iter(tensors.values())).dtype
    config = hf_config(args, dtype, bos_id=bos_id, eos_id=eos_id, layout=layout)
    return write_hf_folder(tensors, config, out_dir, max_shard_size)


def hf_architecture(path: str | os.PathLike):
    """The model args of a Hugging Face checkpoint at ``path`` (folder, file or index) from its config.json; None
    when ``path`` is not one (a DCP folder, nothing there) or has no config.json. HFConfigError / ValueError for a
    config.json titanlike cannot honour."""
    p = Path(path)
    if not p.exists() or (p.is_dir() and (p / ".metadata").is_file()):
        return None
    try:
        files, folder = resolve_weights(p)
    except FileNotFoundError:
        return None
    config = read_hf_config(folder)
    if config is None:
        return None
    return model_args_from_hf_config(config, str(folder / CONFIG_NAME), weight_names=safetensors_shapes(files))


def load_hf(
    path: str | os.PathLike, args=None, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], object]:
    """Read a Hugging Face checkpoint (a folder with config.json and model.safetensors or shards, or one .safetensors
    file) into our FQNs, tensors cast to ``dtype`` if given. ``args`` (the model to load into) is needed when there is
    no config.json; when both exist they must describe the same architecture. Returns (state dict, the weights'
    args)."""
    files, folder = resolve_weights(path)
    config = read_hf_config(folder)
    names = safetensors_shapes(files) if config is not None else None
    file_args = (
        model_args_from_hf_config(config, str(folder / CONFIG_NAME), like=args, weight_names=names)
        if config is not None
        else None
    )
    if file_args is not None and args is not None:
        check_same_architecture(file_args, args, f"'{path}'")
    use = args if args is not None else file_args
    if use is None:
        raise ValueError(f"'{path}' has no {CONFIG_NAME} beside it to say the model's shape")
    return from_hf(read_safetensors(files, dtype), use), use
