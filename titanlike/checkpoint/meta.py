"""``checkpoint.json``: what a checkpoint says about itself, for people and tools (step, kind, the model and its
shape, the layout that wrote it, the tokenizer, the torch version). DCP's ``.metadata`` is the commit marker; this
file is written by rank 0 just before the commit."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

import torch

from titanlike.config import ConfigError

META_NAME = "checkpoint.json"
FORMAT = "titanlike-dcp-1"


def read_meta(path: str | os.PathLike) -> dict:
    """The checkpoint.json of a checkpoint folder ({} when there is none, e.g. a checkpoint written by hand)."""
    p = Path(path) / META_NAME
    if not p.is_file():
        return {}
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"checkpoint '{path}': {META_NAME} is corrupted ({e})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint '{path}': {META_NAME} is corrupted (not a JSON object)")
    return meta


def checkpoint_meta(step: int, kind: str, args, world_size: int, **extra) -> dict:
    """The content of checkpoint.json for a checkpoint of ``kind`` (full / seed / model_only) of the model of
    ``args`` at ``step``."""
    from titanlike.models import spec_for

    return {
        "format": FORMAT,
        "step": step,
        "kind": kind,
        "model": spec_for(args).name,
        "model_args": dataclasses.asdict(args),
        "world_size": world_size,
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extra,
    }


def tokenizer_meta(tokenizer) -> dict:
    """What checkpoint.json records of the tokenizer (Hugging Face export writes bos/eos ids from it): its name and,
    for one read from a file or folder, ``tokenizer_source``, the absolute path that rebuilds it."""
    out = {"tokenizer": tokenizer.name, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    source = getattr(tokenizer, "source", tokenizer.name)
    if source != tokenizer.name:
        out["tokenizer_source"] = source
    return out


def recorded_tokenizer(meta: dict) -> str | None:
    """What ``build_tokenizer`` rebuilds the tokenizer a checkpoint.json records from (None: it records none)."""
    return meta.get("tokenizer_source") or meta.get("tokenizer")


def model_args_of(path: str | os.PathLike):
    """The model args recorded in a checkpoint's checkpoint.json (of the model it names; checkpoints that name
    none were written before there were several models, by the default one)."""
    meta = read_meta(path)
    if "model_args" not in meta:
        raise ConfigError(
            f"checkpoint '{path}' has no {META_NAME} with the model's shape; is it a titanlike checkpoint?"
        )
    from titanlike.models import DEFAULT_MODEL, UnknownModelError, get_spec

    try:
        spec = get_spec(meta.get("model", DEFAULT_MODEL))
    except UnknownModelError as e:
        raise ConfigError(f"checkpoint '{path}': {e}") from None
    return spec.args_from_record(meta["model_args"])
