"""Weights held by one process, to and from checkpoint folders: a seed checkpoint from a state dict (the converter's
``from-hf``) and a Hugging Face folder from a checkpoint (``export_safetensors``, the converter's ``to-hf``)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlike.checkpoint.checksums import ChecksummingWriter, merge_checksums
from titanlike.checkpoint.files import quiet_dcp, write_json
from titanlike.checkpoint.meta import (
    META_NAME,
    checkpoint_meta,
    model_args_of,
    read_meta,
    recorded_tokenizer,
    tokenizer_meta,
)
from titanlike.checkpoint.parts import read_model_state_dict
from titanlike.errors import ConfigError


def write_seed_checkpoint(
    state_dict: dict[str, torch.Tensor], args, out_dir: str | os.PathLike, source: str = "", **extra
) -> Path:
    """Write model weights (plain tensors, our FQNs) as a DCP seed checkpoint in ``out_dir``, atomically, in this
    process. ``out_dir`` must not exist. Any layout can start from it (``checkpoint.initial_load_path``)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = ChecksummingWriter(str(tmp))  # a CRC32C of every entry, verified when it is loaded, as a run's saves
    quiet_dcp(dcp.save, {"model": state_dict}, checkpoint_id=str(tmp), no_dist=True, storage_writer=writer)
    write_json(tmp / META_NAME, checkpoint_meta(0, "seed", args, world_size=1, source=source, **extra))
    merge_checksums(tmp)
    os.rename(tmp, out_dir)
    return out_dir


def resolve_step(path: str | os.PathLike) -> Path:
    """A step folder as given, or a checkpoint folder's newest committed step; ConfigError for anything else."""
    from titanlike.checkpoint.files import committed_checkpoints

    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    steps = committed_checkpoints(p) if p.is_dir() else {}
    if steps:
        return steps[max(steps)]
    raise ConfigError(
        f"'{path}' is not a titanlike checkpoint: neither a step-N folder (with .metadata) nor a folder of them"
    )


def export_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    tokenizer=None,
    with_tokenizer: bool = True,
) -> Path:
    """Write a checkpoint's weights as a Hugging Face folder of its model that ``transformers`` loads as it is:
    model.safetensors (or shards above ``max_shard_size``), config.json, generation_config.json (bos/eos) and the
    tokenizer's files (``titanlike.data.tokenizer_export``), weights cast to ``dtype`` if given. ``step_dir``: a
    step folder or a checkpoint folder (its newest committed step). ``tokenizer``: default, the one the checkpoint
    recorded; a checkpoint that records none gets no tokenizer files (``with_tokenizer=False``: never; the ids of
    ``tokenizer`` still go into config.json).

    Written into a temporary sibling folder and renamed into place; an existing ``out_dir`` is never touched."""
    from titanlike.hf import DEFAULT_MAX_SHARD_SIZE, save_hf

    step_dir = resolve_step(step_dir)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    args = model_args_of(step_dir)
    if tokenizer is None and with_tokenizer:
        tokenizer = _recorded_tokenizer(step_dir)
    meta = tokenizer_meta(tokenizer) if tokenizer is not None else read_meta(step_dir)
    if with_tokenizer and tokenizer is not None and tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids, the model of '{step_dir}' only "
            f"{args.vocab_size}; pass the tokenizer the model was trained with"
        )
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    save_hf(
        read_model_state_dict(step_dir),
        args,
        tmp,
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        dtype=dtype,
        bos_id=meta.get("bos_id"),
        eos_id=meta.get("eos_id"),
    )
    ids = {"bos_token_id": meta.get("bos_id"), "eos_token_id": meta.get("eos_id")}
    generation = {k: v for k, v in ids.items() if v is not None}
    if generation:
        write_json(tmp / "generation_config.json", generation)
    if with_tokenizer and tokenizer is not None:
        from titanlike.data.tokenizer_export import save_hf_tokenizer

        save_hf_tokenizer(tokenizer, tmp, model_max_length=getattr(args, "max_seq_len", None))
    mode = 0o666 & ~_umask()  # safetensors writes its files private (0600): ordinary permissions, as data shards
    for f in tmp.iterdir():
        os.chmod(f, mode)
    os.rename(tmp, out_dir)
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _recorded_tokenizer(step_dir: Path):
    """The tokenizer the checkpoint's checkpoint.json records, built; None when it records none."""
    from titanlike.data import build_tokenizer

    name = recorded_tokenizer(read_meta(step_dir))
    if name is None:
        return None
    try:
        return build_tokenizer(name)
    except ValueError as e:
        raise ConfigError(
            f"the tokenizer '{name}' that '{step_dir}' records cannot be read ({e}); pass --tokenizer <name or folder>"
        ) from None
