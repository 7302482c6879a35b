"""Weights held by one process, to and from checkpoint folders: a seed checkpoint from a state dict (the converter's
``from-hf``) and a Hugging Face folder from a checkpoint (``export_safetensors``, the converter's ``to-hf``)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlike.checkpoint.files import quiet_dcp, write_json
from titanlike.checkpoint.meta import META_NAME, checkpoint_meta, model_args_of, read_meta, tokenizer_meta
from titanlike.checkpoint.parts import read_model_state_dict


def write_seed_checkpoint(
    state_dict: dict[str, torch.Tensor], args, out_dir: str | os.PathLike, source: str = "", **extra
) -> Path:
    """Write model weights (plain tensors, our FQNs) as a DCP seed checkpoint in ``out_dir``, atomically, in this
    process. ``out_dir`` must not exist. Any layout can start from it (``checkpoint.initial_load_path``)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    quiet_dcp(dcp.save, {"model": state_dict}, checkpoint_id=str(tmp), no_dist=True)
    write_json(tmp / META_NAME, checkpoint_meta(0, "seed", args, world_size=1, source=source, **extra))
    os.rename(tmp, out_dir)
    return out_dir


def export_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    tokenizer=None,
) -> Path:
    """Write a checkpoint's weights as a Hugging Face folder of its model (model.safetensors or shards above
    ``max_shard_size`` + config.json), cast to ``dtype`` if given. bos/eos ids come from ``tokenizer`` or, by
    default, the tokenizer recorded in the checkpoint."""
    from titanlike.hf import DEFAULT_MAX_SHARD_SIZE, save_hf

    meta = tokenizer_meta(tokenizer) if tokenizer is not None else read_meta(step_dir)
    return save_hf(
        read_model_state_dict(step_dir),
        model_args_of(step_dir),
        out_dir,
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        dtype=dtype,
        bos_id=meta.get("bos_id"),
        eos_id=meta.get("eos_id"),
    )
