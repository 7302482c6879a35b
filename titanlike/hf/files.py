"""Hugging Face checkpoint files, model-independent: safetensors (one file, or shards listed by an index), the
config.json beside them, atomic output folders and transformers' shard-size spelling.

``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json``
(what ``save_pretrained`` writes above its shard size); float32, bfloat16 or float16 tensors.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "parse_size",
    "read_hf_config",
    "read_safetensors",
    "resolve_safetensors",
    "resolve_weights",
    "safetensors_placeholders",
    "safetensors_shapes",
    "write_hf_folder",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes, as transformers 4 ("5GB")

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` / ``500MiB`` / ``100KB`` / an integer (transformers' max_shard_size spelling)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max shard size {size!r} is not a size like 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _atomic_folder(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    return tmp


def write_hf_folder(
    tensors: dict[str, torch.Tensor], config: dict, out_dir: str | os.PathLike, max_shard_size: int | str
) -> Path:
    """Write ``tensors`` (Hugging Face names) as ``out_dir/model.safetensors`` or, above ``max_shard_size`` bytes,
    as shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (as ``save_pretrained``
    does), and ``config`` as ``out_dir/config.json``.

    Written into a temporary sibling folder and renamed into place; an existing ``out_dir`` is never touched.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    tmp = _atomic_folder(out_dir)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    os.rename(tmp, out_dir)
    return out_dir


def resolve_weights(path: str | os.PathLike) -> tuple[list[Path], Path]:
    """The safetensors files of a Hugging Face checkpoint and the folder holding its config.json.

    ``path`` is a folder (with ``model.safetensors`` or ``model.safetensors.index.json``), a ``.safetensors`` file
    or an index file. FileNotFoundError / ValueError (one line) for anything else, a missing shard included.
    """
    p = Path(path)
    if p.is_dir():
        if (p / INDEX_NAME).is_file():
            p = p / INDEX_NAME
        elif (p / WEIGHTS_NAME).is_file():
            p = p / WEIGHTS_NAME
    if p.is_file() and p.name.endswith(".safetensors.index.json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"'{p}' is not a safetensors index (no weight_map: {e!r})") from None
        missing = [f for f in files if not (p.parent / f).is_file()]
        if missing:
            raise ValueError(f"'{p}' lists shards that are not there: {', '.join(missing)}")
        return [p.parent / f for f in files], p.parent
    if not p.is_file() or p.suffix != ".safetensors":
        raise FileNotFoundError(
            f"'{path}' is not a .safetensors file or a folder holding {WEIGHTS_NAME} or {INDEX_NAME}"
        )
    return [p], p.parent


def resolve_safetensors(path: str | os.PathLike) -> Path:
    """The single safetensors file (or index) of ``path``; kept for callers that name one file."""
    files, _ = resolve_weights(path)
    return files[0]


def read_hf_config(folder: Path) -> dict | None:
    """The config.json in ``folder`` (or beside a file given instead), or None."""
    folder = Path(folder)
    cfg = (folder if folder.is_dir() else folder.parent) / CONFIG_NAME
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"'{cfg}' is not valid JSON: {e}") from None


def safetensors_shapes(weights: Path | list[Path]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the safetensors file(s), from their headers (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for w in [weights] if isinstance(weights, Path) else weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                for k in f.keys():
                    if k in out:
                        raise ValueError(f"'{k}' is in more than one shard ('{w}' and another)")
                    out[k] = tuple(f.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"'{w}' is not a readable safetensors file ({e})") from None
    return out


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def safetensors_placeholders(weights: Path | list[Path]) -> dict[str, torch.Tensor]:
    """HF name -> a meta tensor of each tensor's shape and dtype (from the headers; no data is read): what a
    conversion can run on to check a checkpoint fits before any weight is loaded (MXFP4 blocks stay uint8)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for w in [weights] if isinstance(weights, Path) else weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    dtype = getattr(torch, _SAFETENSORS_DTYPES.get(s.get_dtype(), "float32"))
                    out[k] = torch.empty(tuple(s.get_shape()), dtype=dtype, device="meta")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"'{w}' is not a readable safetensors file ({e})") from None
    return out


def read_safetensors(files: list[Path], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``files`` by its Hugging Face name, floating ones cast to ``dtype`` if given."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = {}
    for w in files:
        try:
            part = load_file(str(w))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"'{w}' is not a readable safetensors file ({e})") from None
        out.update({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in part.items()})
    return out
