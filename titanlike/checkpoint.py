"""Checkpoints that survive anything: DCP save/load, atomic commits, resume under any layout, seed checkpoints.

Layout on disk (``checkpoint.folder``, relative to ``job.dump_folder``)::

    step-200/                  a committed checkpoint: DCP files (.metadata, __<rank>_0.distcp) + checkpoint.json
                               (+ checksums.json with checkpoint.checksum)
    step-300.tmp-1a2b3c4d/     a save in progress, or one killed mid-write: ignored, removed at the next start
    step-400.incomplete-…/     a step folder without .metadata found at the start, set aside (never resumed)
    final/                     checkpoint.export_safetensors: model.safetensors + config.json (Hugging Face Llama)

What a checkpoint holds (one DCP state dict, keyed by the plain model's FQNs):

* ``model.<fqn>``: every parameter, from all model parts (pipeline stages) of all ranks. DTensor shards (FSDP, TP)
  are saved as shards of the full tensor, so a checkpoint loads under any other layout, or in one process;
* ``optimizer.state.<fqn>.exp_avg`` ... : AdamW, flattened by FQN (``flatten_optimizer_state_dict``) so it reshards
  the same way;
* ``train.*``: step, tokens seen, non-finite step count, the data position (a *global* sample index, valid for any
  data-parallel degree) and the LR scheduler;
* ``rng.rank<r>.*``: each rank's torch RNG state, restored only when the world size is unchanged.

**Atomic commit.** Every rank writes into ``step-N.tmp-<run id>/``. DCP's coordinator writes ``.metadata`` only after
gathering every rank's write results (so after all data files exist); then rank 0 adds ``checkpoint.json`` and renames
the folder to ``step-N``. A rename is atomic, so a ``step-N`` folder is always complete and a kill -9 at any moment
leaves the previous one loadable. Old checkpoints (``keep_latest_k``) are renamed aside before they are deleted.

**Faults.** Every collective runs on a group bounded by ``comm.timeout_seconds`` and inside ``fault.operation``,
which names the ranks that stopped answering; a failed write removes its temporary folder and names the free space;
``checkpoint.checksum`` records a CRC-32 per file, verified before a resume (``checkpoint.on_corrupt``).

**Resume.** With ``checkpoint.enable``, the newest committed ``step-N`` (or ``checkpoint.load_step``) is loaded; a
seed checkpoint (model only) starts at step 0. Without one, ``checkpoint.initial_load_path`` (a seed / step folder,
or a Hugging Face ``.safetensors``) gives the initial weights. Every problem with the input is found before anything
is loaded or written, by rank 0, and raised on every rank as one :class:`ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanlike import fault, restricted_unpickle
from titanlike.config import ConfigError, JobConfig
from titanlike.models import ModelArgs

META_NAME = "checkpoint.json"
FORMAT = "titanlike-dcp-1"
STEP_DIR = re.compile(r"step-(\d+)")
_LEFTOVER_DIR = re.compile(r"(step-\d+|final)\.(tmp|new|trash)-[\w.-]+")  # killed saves, deletions in progress
# What a save of ours writes into such a folder: a leftover holding anything else is not removed.
_OUR_FILES = re.compile(
    r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+_crc32\.json|checkpoint\.json|checksums\.json"
    r"|model\.safetensors|config\.json|\.write-test-\w+"
)
CHECKSUMS_NAME = "checksums.json"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_SINGLE_PROCESS_NOTE = r"torch\.distributed is (disabled, )?unavailable or uninitialized"
# DCP notes on every single-process save/load that it "assumes the intent": it is ours. Filtered for the process
# (an async save warns from its own thread, outside any catch_warnings) and again around each call (pytest resets).
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)


def _dcp(fn, *args, **kwargs):
    """Call a DCP function without its warnings that a single-process run "assumes the intent" (it is ours) and
    that async saves are experimental."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
        warnings.filterwarnings("ignore", message=r".*experimental")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- the folder
def checkpoint_folder(cfg: JobConfig) -> Path:
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def committed_checkpoints(folder: str | os.PathLike) -> dict[int, Path]:
    """step -> folder of every committed checkpoint in ``folder`` (``step-N`` holding DCP metadata), by step."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if m and (p / ".metadata").is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _remove_dir(path: Path, run_id: str) -> None:
    """Rename aside (atomic: the folder stops looking committed at once), then delete."""
    trash = path.with_name(f"{path.name}.trash-{run_id}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _only_ours(folder: Path) -> bool:
    """True when ``folder`` holds only files that a checkpoint save or export writes (safe to delete)."""
    return all(f.is_file() and _OUR_FILES.fullmatch(f.name) for f in folder.iterdir())


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and prove a file can be written in it; ConfigError otherwise."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"checkpoint.folder: '{folder}' is a file, not a folder; choose another checkpoint.folder "
            f"or job.dump_folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"checkpoint.folder: cannot write checkpoints to '{folder}' ({e.strerror or e}); "
            f"choose a writable checkpoint.folder or job.dump_folder"
        ) from None


# ---------------------------------------------------------------------------------------------------- validation
def read_dcp_metadata(path: str | os.PathLike):
    """The DCP metadata of a checkpoint folder, after checking every data file it names is there in full.

    A truncated or missing file, or an unreadable ``.metadata``, is a ConfigError naming the checkpoint.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        what = "does not exist" if not path.exists() else "is not a checkpoint folder (it has no .metadata)"
        raise ConfigError(f"checkpoint '{path}' {what}")
    try:
        metadata = restricted_unpickle.read_metadata(path)  # executes nothing from the file (restricted_unpickle.py)
    except restricted_unpickle.UnsafeCheckpointError as e:
        raise ConfigError(f"checkpoint '{path}' is refused: its .metadata {e}") from None
    except Exception as e:  # noqa: BLE001 - pickle raises anything on a corrupted file
        raise ConfigError(
            f"checkpoint '{path}' is corrupted: its .metadata cannot be read ({type(e).__name__}: {e})"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have} of {size} bytes)"
            raise ConfigError(f"checkpoint '{path}' is corrupted: {name} {what}")
    return metadata


def check_model_fits(metadata, expected: dict[str, torch.Size], path: str | os.PathLike) -> None:
    """ConfigError unless the checkpoint's ``model.*`` entries are exactly the model's FQNs with its shapes."""
    saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    if not saved:
        raise ConfigError(f"checkpoint '{path}' holds no model weights; is it a titanlike checkpoint?")
    for fqn, shape in expected.items():
        if fqn not in saved:
            raise ConfigError(f"checkpoint '{path}' is for a different model: it has no '{fqn}'")
        have = tuple(getattr(saved[fqn], "size", ()))
        if have != tuple(shape):
            raise ConfigError(
                f"checkpoint '{path}' is for a different model: '{fqn}' has shape {have} there, {tuple(shape)} here"
            )
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise ConfigError(
            f"checkpoint '{path}' is for a different model: it has '{extra[0]}', which this model has not"
        )


# ---------------------------------------------------------------------------------------------------- checksums
_CHUNK = 16 << 20


def file_crc32(path: Path) -> str:
    """CRC-32 of a file's bytes (zlib's, read in 16 MiB chunks), as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that, once this rank's data files are written (and fsynced), records their CRC-32 in a
    small ``__<rank>_crc32.json`` beside them. The ranks hash in parallel (and, for an async save, in the
    background thread), before DCP's coordinator writes ``.metadata``; at the commit rank 0 merges the records into
    ``checksums.json``."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        files = sorted({r.storage_data.relative_path for r in results})
        sums = {
            name: {"crc32": file_crc32(Path(self.path) / name), "size": (Path(self.path) / name).stat().st_size}
            for name in files
        }
        _write_json(Path(self.path) / f"{plan.storage_data.prefix}crc32.json", sums)
        return future


def _merge_checksums(folder: Path) -> None:
    """Rank 0, at the commit: every rank's records plus .metadata and checkpoint.json -> checksums.json."""
    sums = {}
    for part in sorted(folder.glob("__*_crc32.json")):
        sums.update(json.loads(part.read_text()))
    for name in (".metadata", META_NAME):
        sums[name] = {"crc32": file_crc32(folder / name), "size": (folder / name).stat().st_size}
    _write_json(folder / CHECKSUMS_NAME, {"algorithm": "crc32", "files": dict(sorted(sums.items()))})
    for part in folder.glob("__*_crc32.json"):
        part.unlink()


def read_checksums(path: str | os.PathLike) -> dict | str | None:
    """The ``{file: {"crc32", "size"}}`` recorded in a checkpoint's ``checksums.json``; None when there is none, a
    text saying why when it cannot be read."""
    record = Path(path) / CHECKSUMS_NAME
    if not record.is_file():
        return None
    try:
        files = json.loads(record.read_text())["files"]
        if not all(isinstance(v, dict) and {"crc32", "size"} <= v.keys() for v in files.values()):
            raise TypeError("an entry lacks crc32 or size")
        return files
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        return f"its {CHECKSUMS_NAME} cannot be read ({type(e).__name__}: {e})"


def verify_checksums(path: str | os.PathLike, rank: int = 0, world_size: int = 1) -> str | None:
    """Compare the files of a checkpoint with its ``checksums.json`` (this rank's share: every ``world_size``-th
    file from ``rank``); the first mismatch as text (None: all equal, or no checksums were recorded)."""
    path = Path(path)
    files = read_checksums(path)
    if files is None or isinstance(files, str):
        return files
    for name, want in sorted(files.items())[rank::world_size]:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, {want['size']} were written"
        have = file_crc32(f)
        if have != want["crc32"]:
            return f"{name} does not match its checksum (crc32 {have}, {want['crc32']} was written)"
    return None


# ---------------------------------------------------------------------------------------------------- model parts
class ModelPartsView(nn.Module):
    """One module whose parameters are those of several model parts under their plain-model FQNs.

    Under pipeline parallelism a rank holds several stages (the spec's partial-stage ``build``), each with FQNs of
    the full model; their top-level children are disjoint except the block container (a ``ModuleDict`` or a pruned
    ``ModuleList``), whose entries are merged. The view only
    references the parts' modules (FSDP's state-dict hooks live on those), so ``get/set_model_state_dict`` and
    ``get/set_optimizer_state_dict`` on it see exactly the plain model's names.
    """

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        for part in parts:
            if next(part.parameters(recurse=False), None) is not None:
                raise ValueError("model parts with parameters of their own (not in a child module) cannot be merged")
            self._merge(self, part)

    @staticmethod
    def _merge(into: nn.Module, part: nn.Module) -> None:
        for name, child in part.named_children():
            have = into._modules.get(name)
            if have is None:
                # a block container (a stage keeps its entries' keys, so FQNs): merged entry by entry
                into.add_module(
                    name,
                    nn.ModuleDict(dict(child.named_children()))
                    if isinstance(child, (nn.ModuleDict, nn.ModuleList))
                    else child,
                )
            elif isinstance(have, nn.ModuleDict) and isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                for key, sub in child.named_children():
                    if key in have:
                        raise ValueError(f"model parts both hold '{name}.{key}'")
                    have[key] = sub
            elif have is not child and not (_stateless(have) and _stateless(child)):
                raise ValueError(f"model parts both hold '{name}'")


def _stateless(module: nn.Module) -> bool:
    """No parameters or buffers anywhere inside (a seam every pipeline stage keeps, e.g. the decoder's positions):
    nothing of it is in a state dict, so several stages' copies need no merging."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def merged_model(parts: Sequence[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else ModelPartsView(parts)


def _local_tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        if isinstance(v, dict):
            out += _local_tensors(v)
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


# ---------------------------------------------------------------------------------------------------- any module
def _parts_state(model: nn.Module, optimizer) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    return state


def save_parts(
    path: str | os.PathLike, model_parts: Sequence[nn.Module], optimizer=None, *, process_group=None
) -> None:
    """Save the model (and AdamW state) of this rank's ``model_parts`` to the DCP folder ``path``, keyed by the plain
    model's FQNs: ``model.<fqn>``, ``optimizer.state.<fqn>.exp_avg``, ... . Collective over ``process_group``
    (default: the world). Any layout writes the single-device tensors (FSDP / TP shards, fused projections in their
    q|k|v order), so the folder loads under any other layout, or in one process (:func:`read_model_state_dict`).
    For any ``nn.Module``; the trainer's :class:`CheckpointManager` adds atomic commits, data / RNG state, resume."""
    from titanlike.parallel.fused import contiguous_for_dcp_tree

    state = contiguous_for_dcp_tree(_parts_state(merged_model(list(model_parts)), optimizer))
    kwargs = {"process_group": process_group} if dist.is_initialized() else {"no_dist": True}
    _dcp(dcp.save, state, checkpoint_id=str(path), **kwargs)


def load_parts(
    path: str | os.PathLike, model_parts: Sequence[nn.Module], optimizer=None, *, process_group=None
) -> None:
    """Load a :func:`save_parts` folder (written under any layout) into this rank's ``model_parts`` (and the
    optimizer's state), in place. Executes nothing from the files (``restricted_unpickle``)."""
    from titanlike.parallel.fused import contiguous_for_dcp, restore_layout

    model = merged_model(list(model_parts))
    originals = _flatten(_parts_state(model, optimizer))
    flat = contiguous_for_dcp(originals)
    kwargs = {"process_group": process_group} if dist.is_initialized() else {"no_dist": True}
    _dcp(restricted_unpickle.load, flat, checkpoint_id=str(path), **kwargs)
    flat = restore_layout(flat, originals)
    set_model_state_dict(model, {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")})
    if optimizer is not None:
        set_optimizer_state_dict(
            model,
            optimizer,
            {k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")},
            options=_OPTIM_OPTIONS,
        )


# ---------------------------------------------------------------------------------------------------- single process
def read_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint folder written under any layout, read in this process."""
    metadata = read_dcp_metadata(path)
    sd = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            sd[key[len("model.") :]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not sd:
        raise ConfigError(f"checkpoint '{path}' holds no model weights; is it a titanlike checkpoint?")
    _dcp(restricted_unpickle.load, {"model": sd}, checkpoint_id=str(path), no_dist=True)
    return sd


def write_seed_checkpoint(
    state_dict: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike, source: str = "", **extra
) -> Path:
    """Write model weights (plain tensors, our FQNs) as a DCP seed checkpoint in ``out_dir``, atomically, in this
    process. ``out_dir`` must not exist. Any layout can start from it (``checkpoint.initial_load_path``)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"'{out_dir}' already exists; not overwriting it")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    _dcp(dcp.save, {"model": state_dict}, checkpoint_id=str(tmp), no_dist=True)
    _write_json(tmp / META_NAME, _meta(0, "seed", args, world_size=1, source=source, **extra))
    os.rename(tmp, out_dir)
    return out_dir


def _meta(step: int, kind: str, args: ModelArgs, world_size: int, **extra) -> dict:
    from titanlike.models import spec_for

    return {
        "format": FORMAT,
        "step": step,
        "kind": kind,
        "model": spec_for(args).name,
        "model_args": dataclasses.asdict(args),
        "world_size": world_size,
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def model_args_of(path: str | os.PathLike) -> ModelArgs:
    """The ModelArgs recorded in a checkpoint's checkpoint.json."""
    meta = read_meta(path)
    if "model_args" not in meta:
        raise ConfigError(
            f"checkpoint '{path}' has no {META_NAME} with the model's shape; is it a titanlike checkpoint?"
        )
    from titanlike.models import DEFAULT_MODEL, UnknownModelError, get_spec

    try:
        spec = get_spec(meta.get("model", DEFAULT_MODEL))  # checkpoints written before model specs: the default
    except UnknownModelError as e:
        raise ConfigError(f"checkpoint '{path}': {e}") from None
    return spec.args_cls(**meta["model_args"])


def tokenizer_meta(tokenizer) -> dict:
    """What checkpoint.json records of the tokenizer (Hugging Face export writes bos/eos ids from it)."""
    return {"tokenizer": tokenizer.name, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def export_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    tokenizer=None,
) -> Path:
    """Write a checkpoint's weights as a Hugging Face Llama folder (model.safetensors or shards above
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


def _tied_alias(key: str) -> str | None:
    """The optimizer-state key of the input embedding for one of the (tied) output head, else None.

    A tied model saved without pipelining has one parameter under two names, and the flattened optimizer state
    lists it once, as ``tok_embeddings.weight``; a last pipeline stage holds its own copy as ``output.weight``.
    """
    for prefix in ("optimizer.state.output.weight.", "optimizer.param_groups.output.weight."):
        if key.startswith(prefix):
            return key.replace(".output.weight.", ".tok_embeddings.weight.", 1)
    return None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------------- the manager
class CheckpointSaveError(fault.ReportedError):
    """A save could not be written; its partial folder is removed and the previous checkpoint is intact."""


def _root_cause(exc: BaseException) -> str:
    """'[Errno 28] No space left on device' for an OSError anywhere in ``exc`` (DCP wraps the ranks' failures),
    else its telling line."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return f"[Errno {e.errno}] {e.strerror}"
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return fault.first_line(exc)


class CheckpointManager:
    """Saves and restores the state of a run, given as named pieces (as torchtitan does):

    * ``model_parts``: this rank's model modules (one, or its pipeline stages);
    * ``optimizer`` and ``lr_scheduler``: ``state_dict`` / ``load_state_dict`` objects;
    * ``dataloader``: a ``TokenDataLoader`` (its position, a global sample index, is what is saved);
    * ``train_state``: a ``Stateful`` whose ``state_dict()`` holds the counters ``step``, ``tokens_seen`` and
      ``nonfinite_steps``; a resume sets them back with ``load_state_dict``.

    ``cfg`` (the ``JobConfig``), ``model_args``, the ``tokenizer`` (recorded in the checkpoint's metadata), the device
    and the process layout are read, never written.
    Constructing the manager is collective when distributed, and validates every input (raising the same
    :class:`ConfigError` on every rank); ``load``, ``maybe_save`` and ``finish`` are collective too.
    """

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model_parts,
        optimizer,
        lr_scheduler,
        dataloader,
        train_state,
        model_args: ModelArgs,
        tokenizer,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        dp_degree: int | None = None,
    ):
        self.cfg = cfg.checkpoint
        self.timeout = datetime.timedelta(seconds=cfg.comm.timeout_seconds)
        self.folder = checkpoint_folder(cfg)
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.train_state, self.model_args, self.tokenizer, self.device = train_state, model_args, tokenizer, device
        self.rank, self.world_size, self.dp_degree = rank, world_size, dp_degree
        self.distributed = world_size > 1
        self.optimizer_name = cfg.optimizer.name  # recorded by full saves; a resume needs the same optimizer's state
        # What a seed checkpoint records of how its weights were made (checkpoint.json): the initialisation seed, the
        # dtype of the weights and the layout that wrote it (any layout loads it).
        from titanlike.layout import Degrees, master_dtype

        d = Degrees.from_config(cfg, world_size)
        self.seed_meta = {
            "seed": cfg.training.seed,
            "dtype": master_dtype(cfg.training.dtype),
            "layout": {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp},
        }
        self.model = merged_model(model_parts)
        # A gloo group of its own: DCP exchanges only plans and metadata (any device), an async save runs its
        # collectives on it from a background thread without interleaving with the training collectives, and
        # gloo has monitored_barrier, which names the ranks that do not arrive.
        # Created (a store rendezvous) under comm.init_timeout_seconds; the trainer then bounds it, like every other
        # group, by comm.timeout_seconds (torch's default for a new gloo group would be 30 minutes).
        init_timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
        self.pg = dist.new_group(backend="gloo", timeout=init_timeout) if self.distributed else None
        self.pending: tuple | None = None  # async save in flight: (future, step, tmp folder, start, meta)
        self.last_step: int | None = None  # newest step committed or loaded by this run
        self._corrupt: dict[str, str] = {}  # path -> why, of checkpoints whose checksums did not match (_verify)
        self.plan = self._agree(self._make_plan)
        self._verify()
        self._tidy()

    def _op(self, what: str):
        """A phase whose failed collectives are reported naming the ranks that stopped answering (fault.py)."""
        return fault.operation(
            what,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.timeout.total_seconds(),
            enabled=self.distributed,
        )

    # ------------------------------------------------------------------------------------------ input checks
    def _agree(self, fn):
        """Run ``fn`` on rank 0 and give its result, or its error, to every rank (none is left waiting)."""
        result = None
        if self.rank == 0:
            try:
                result = fn()
            except ConfigError as e:
                result = {"error": str(e)}
            except Exception as e:  # noqa: BLE001 - not the input's fault: re-raised below as what it is
                result = {"failure": f"checkpoint setup failed on rank 0: {type(e).__name__}: {e}"}
        if self.distributed:
            box = [result]
            with self._op("the checkpoint setup (rank 0 checks the checkpoint folder)"):
                dist.broadcast_object_list(box, src=0, group=self.pg)
            result = box[0]
        if "error" in result:
            raise ConfigError(result["error"])
        if "failure" in result:
            raise RuntimeError(result["failure"])
        return result

    def _expected_model(self) -> dict[str, torch.Size]:
        from titanlike.hf import expected_shapes

        return expected_shapes(self.model_args)

    def _make_plan(self) -> dict:
        c, folder = self.cfg, self.folder
        plan = {"run_id": uuid.uuid4().hex[:8], "action": "fresh"}
        if c.create_seed_checkpoint:
            ignored = [
                k
                for k, v in (
                    ("initial_load_path", c.initial_load_path),
                    ("load_step", c.load_step >= 0),
                    ("export_safetensors", c.export_safetensors),
                )
                if v
            ]
            if ignored:
                raise ConfigError(
                    f"checkpoint.create_seed_checkpoint writes the weights initialised from "
                    f"training.seed and exits: {', '.join('checkpoint.' + k for k in ignored)} would be "
                    f"ignored; remove {'it' if len(ignored) == 1 else 'them'} (a Hugging Face folder "
                    f"becomes a seed checkpoint with scripts/convert_checkpoint.py from-hf)"
                )
            existing = committed_checkpoints(folder)
            if existing:
                raise ConfigError(
                    f"checkpoint.create_seed_checkpoint: '{folder}' already holds checkpoints "
                    f"({', '.join(f'step-{s}' for s in existing)}); not overwriting them, choose an "
                    f"empty checkpoint.folder"
                )
            check_writable(folder)
            return {**plan, "action": "seed"}
        if c.export_safetensors and not c.enable:
            raise ConfigError(
                "checkpoint.export_safetensors exports the final checkpoint: set checkpoint.enable = true as well"
            )
        if c.load_step >= 0 and not c.enable:
            raise ConfigError(f"checkpoint.load_step {c.load_step} needs checkpoint.enable = true")
        expected = self._expected_model()
        if c.enable:
            check_writable(folder)
            found = committed_checkpoints(folder)
            if c.load_step >= 0:
                if c.load_step not in found:
                    have = ", ".join(map(str, found)) or "none"
                    raise ConfigError(
                        f"checkpoint.load_step {c.load_step}: there is no committed checkpoint "
                        f"step-{c.load_step} in '{folder}' (steps there: {have})"
                    )
                later = [s for s in found if s > c.load_step]
                if later:
                    raise ConfigError(
                        f"checkpoint.load_step {c.load_step}: '{folder}' also holds later checkpoints "
                        f"({', '.join(map(str, later))}) that this run would overwrite or purge; move "
                        f"them away or resume into another checkpoint.folder"
                    )
                found = {c.load_step: found[c.load_step]}
            corrupt: list[tuple[Path, str]] = []  # newest first, set aside when an older one resumes
            for step, path in sorted(found.items(), reverse=True):
                try:
                    metadata = self._check_intact(path)
                except ConfigError as e:
                    if c.load_step >= 0:
                        raise ConfigError(f"{e}; repair it or choose another checkpoint.load_step") from None
                    if c.on_corrupt == "previous":
                        corrupt.append((path, str(e)))
                        continue
                    raise ConfigError(
                        f"{e}; move it out of '{folder}' to resume from the checkpoint before it "
                        f'(or set checkpoint.on_corrupt = "previous"), or repair it'
                    ) from None
                if read_meta(path).get("kind") == "model_only":
                    raise ConfigError(
                        f"checkpoint '{path}' is the model-only last save of a finished run "
                        f"(checkpoint.last_save_model_only): it cannot resume training; start a new "
                        f"run from it with checkpoint.initial_load_path (in another checkpoint.folder), "
                        f"or move it away to resume from the checkpoint before it"
                    )
                check_model_fits(metadata, expected, path)
                keys = metadata.state_dict_metadata
                saved_by = read_meta(path).get("optimizer", "AdamW")  # checkpoints from before Muon: AdamW
                if saved_by != self.optimizer_name and any(k.startswith("optimizer.") for k in keys):
                    raise ConfigError(
                        f"checkpoint '{path}' holds {saved_by}'s optimizer state and this run's optimizer.name is "
                        f"{self.optimizer_name!r}; resume with optimizer.name = {saved_by!r}, or start "
                        f"{self.optimizer_name} from its weights: checkpoint.initial_load_path = '{path}' with "
                        f"another checkpoint.folder"
                    )
                return {
                    **plan,
                    "action": "resume",
                    "path": str(path),
                    "step": step,
                    "corrupt": [(str(p), why) for p, why in corrupt],
                    "full": any(k.startswith("optimizer.") for k in keys),
                    "tied_alias": not any(k.startswith("optimizer.state.output.weight.") for k in keys),
                    "rng_world_size": read_meta(path).get("world_size"),
                }
            if corrupt:
                raise ConfigError(
                    f"no intact checkpoint in '{folder}' to resume from (checkpoint.on_corrupt = "
                    f'"previous"): {corrupt[-1][1]}; repair one or move them away to start over'
                )
        if c.initial_load_path:
            plan = {**plan, **self._plan_initial(Path(c.initial_load_path), expected)}
        return plan

    def _check_intact(self, path: Path):
        """The DCP metadata of a committed checkpoint after checking its files' sizes (and, with checkpoint.checksum,
        that its checksums.json is readable; the CRCs are compared by every rank, see _verify); a ConfigError naming
        the first problem otherwise. A checkpoint found corrupted by _verify is reported here on the re-plan."""
        if str(path) in self._corrupt:
            raise ConfigError(self._corrupt[str(path)])
        metadata = read_dcp_metadata(path)
        read_meta(path)
        if self.cfg.checksum and isinstance(read_checksums(path), str):
            raise ConfigError(f"checkpoint '{path}' is corrupted: {read_checksums(path)}")
        return metadata

    def _verify(self) -> None:
        """With checkpoint.checksum, before a resume: every rank compares its share of the checkpoint's files with
        their CRC-32 (the reading is spread over the ranks), the first mismatch is shared, and it stops the run
        (on_corrupt = "stop", or a load_step) or sends rank 0 back to plan the newest intact checkpoint
        ("previous"). Nothing on disk is changed here; set-asides happen in _tidy once a checkpoint passed."""
        c = self.cfg
        while c.checksum and self.plan["action"] == "resume":
            path, world = self.plan["path"], self.world_size if self.distributed else 1
            problem = verify_checksums(path, self.rank, world)
            if self.distributed:
                problems = [None] * world
                with self._op(f"the checksum verification of step {self.plan['step']}"):
                    dist.all_gather_object(problems, problem, group=self.pg)
                problem = next((p for p in problems if p is not None), None)
            if problem is None:
                return
            msg = f"checkpoint '{path}' is corrupted: {problem}"
            if c.load_step >= 0:
                raise ConfigError(f"{msg}; repair it or choose another checkpoint.load_step")
            if c.on_corrupt != "previous":
                raise ConfigError(
                    f"{msg}; move it out of '{self.folder}' to resume from the checkpoint before it "
                    f'(or set checkpoint.on_corrupt = "previous"), or repair it'
                )
            self._corrupt[path] = msg
            self.plan = self._agree(self._make_plan)

    def _tidy(self) -> None:
        """Rank 0, once the input is known good: set aside corrupted checkpoints that are skipped and ``step-N``
        folders without their commit marker (.metadata; never "newest", and their step is saved again without a
        conflict), and delete the temporary folders of dead runs when they hold only files a save writes."""
        if self.rank != 0 or not (self.cfg.enable or self.plan["action"] == "seed"):
            return
        folder, run_id = self.folder, self.plan["run_id"]
        for path, why in self.plan.get("corrupt", []):
            path = Path(path)
            aside = path.with_name(f"{path.name}.corrupt-{run_id}")
            os.rename(path, aside)
            print(f"checkpoint: {why}; set aside as {aside.name}, resuming from an older checkpoint", flush=True)
        removed, kept = [], []
        for p in sorted(folder.iterdir()):
            if not p.is_dir():
                continue
            if STEP_DIR.fullmatch(p.name) and not (p / ".metadata").is_file():
                aside = p.with_name(f"{p.name}.incomplete-{run_id}")
                os.rename(p, aside)
                print(
                    f"checkpoint: {p} has no .metadata (its save was never committed): set aside as {aside.name}",
                    flush=True,
                )
            elif _LEFTOVER_DIR.fullmatch(p.name):
                if _only_ours(p):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
                else:
                    kept.append(p.name)
        if removed:
            print(
                f"checkpoint: removed {len(removed)} temporary folder(s) of interrupted saves: {', '.join(removed)}",
                flush=True,
            )
        if kept:
            print(
                f"checkpoint: not removing {', '.join(kept)}: they hold files a checkpoint save does not write",
                flush=True,
            )

    def _plan_initial(self, path: Path, expected: dict[str, torch.Size]) -> dict:
        from titanlike import hf

        if not path.exists():
            raise ConfigError(f"checkpoint.initial_load_path: '{path}' does not exist")
        if path.is_dir() and (path / ".metadata").is_file():
            check_model_fits(read_dcp_metadata(path), expected, path)
            return {"action": "initial_dcp", "path": str(path)}
        try:
            files, folder = hf.resolve_weights(path)
            shapes = hf.safetensors_shapes(files)
            config = hf.read_hf_config(folder)
            if config is not None:
                hf.check_same_architecture(
                    hf.model_args_from_hf_config(config, str(folder / hf.CONFIG_NAME)), self.model_args, f"'{path}'"
                )
            hf.from_hf({k: torch.empty(s, device="meta") for k, s in shapes.items()}, self.model_args)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(
                f"checkpoint.initial_load_path: {e}; give a checkpoint step folder or a Hugging "
                f"Face folder / .safetensors of this model"
            ) from None
        weights = path
        return {"action": "initial_hf", "path": str(weights)}

    # ------------------------------------------------------------------------------------------ state
    def _train_state(self) -> dict:
        from titanlike.data import loader_position

        counters = self.train_state.state_dict()
        return {
            "step": counters["step"],
            "tokens_seen": counters["tokens_seen"],
            "nonfinite_steps": counters["nonfinite_steps"],
            "data_position": loader_position(self.dataloader),
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def _rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return {f"rank{self.rank}": state}

    def _state(self) -> dict:
        from titanlike.parallel.fused import contiguous_for_dcp_tree

        # Chunk-sharded DTensors (fused projections under TP) as plain-Shard layouts: DCP writes one contiguous block
        # per rank, and the files keep the single-device order (titanlike/parallel/fused.py).
        return {
            "model": contiguous_for_dcp_tree(get_model_state_dict(self.model)),
            "optimizer": contiguous_for_dcp_tree(
                get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIM_OPTIONS)
            ),
            "train": self._train_state(),
            "rng": self._rng_state(),
        }

    def _dcp_kwargs(self) -> dict:
        return {"process_group": self.pg} if self.distributed else {"no_dist": True}

    # ------------------------------------------------------------------------------------------ seed
    def maybe_create_seed_checkpoint(self) -> bool:
        """With checkpoint.create_seed_checkpoint: write the initial weights as ``step-0`` and return True.

        Collective: every rank writes its own shards (DCP, under the run's real layout, nothing gathered), then rank
        0 commits the folder like any save (checkpoint.json, checksums, one atomic rename) and every rank returns
        once ``step-0`` exists. Any other layout (or one process) starts from it by resharding on load."""
        if self.plan["action"] != "seed":
            return False
        from titanlike.parallel.fused import contiguous_for_dcp_tree

        t0 = time.perf_counter()
        what = "the seed checkpoint save"
        tmp = self.folder / f"step-0.tmp-{self.plan['run_id']}"
        with self._op(what):
            if self.distributed:
                self._barrier(what)
            state = {"model": contiguous_for_dcp_tree(get_model_state_dict(self.model))}
            self._check_finite({**state, "optimizer": {}}, 0)
            kwargs = {**self._dcp_kwargs(), "checkpoint_id": str(tmp)}
            if self.cfg.checksum:
                kwargs["storage_writer"] = ChecksummingWriter(str(tmp))
            try:
                _dcp(dcp.save, state, **kwargs)
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raises its gathered failures
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(0, tmp, e)
        self._commit(
            0,
            tmp,
            t0,
            _meta(
                0,
                "seed",
                self.model_args,
                world_size=self.world_size,
                **self.seed_meta,
                **tokenizer_meta(self.tokenizer),
            ),
        )
        if self.distributed:  # nobody leaves (and ends the job) before rank 0 renamed the folder
            with self._op("the seed checkpoint commit"):
                dist.barrier(group=self.pg)
        if self.rank == 0:
            print(
                f"checkpoint: {self.folder / 'step-0'} is a seed checkpoint (each of {self.world_size} process(es) "
                f"wrote its own shards); start any layout from it with "
                f"checkpoint.initial_load_path={self.folder / 'step-0'}",
                flush=True,
            )
        return True

    # ------------------------------------------------------------------------------------------ load
    def load(self) -> int | None:
        """Restore what the plan says (resume / initial weights / nothing); return the step resumed from."""
        plan, t0 = self.plan, time.perf_counter()
        action = plan["action"]
        if action == "resume":
            with self._op(f"the checkpoint load of step {plan['step']}"):
                self._load_dcp(
                    plan["path"],
                    full=plan["full"],
                    tied_alias=plan["tied_alias"],
                    rng=plan["rng_world_size"] == self.world_size,
                )
            what = (
                f"resumed from {plan['path']} (step {self.train_state.state_dict()['step']})"
                if plan["full"]
                else f"loaded the seed weights {plan['path']}"
            )
            self.last_step = plan["step"]
        elif action == "initial_dcp":
            with self._op("the load of the initial weights"):
                self._load_dcp(plan["path"], full=False, tied_alias=False, rng=False)
            what = f"loaded the initial weights {plan['path']}"
        elif action == "initial_hf":
            self._load_hf(plan["path"])
            what = f"loaded the initial weights {plan['path']} (Hugging Face)"
        else:
            return None
        if self.rank == 0:
            print(f"checkpoint: {what} in {time.perf_counter() - t0:.2f}s", flush=True)
        return self.train_state.state_dict()["step"]

    def _load_dcp(self, path: str, *, full: bool, tied_alias: bool, rng: bool) -> None:
        state: dict = {"model": get_model_state_dict(self.model)}
        if full:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIM_OPTIONS)
            state["train"] = self._train_state()
            if rng:
                state["rng"] = self._rng_state()
        flat = _flatten(state)
        # Tied embeddings: optimizer entries of a pipeline stage's own output.weight copy come from the embedding's.
        aliased = {}
        if full and tied_alias and self.model_args.tie_embeddings:
            aliased = {_tied_alias(k): flat.pop(k) for k in list(flat) if _tied_alias(k)}
        from titanlike.parallel.fused import contiguous_for_dcp, restore_layout

        originals = {**flat, **aliased}
        flat, aliased = contiguous_for_dcp(flat), contiguous_for_dcp(aliased)
        try:
            _dcp(restricted_unpickle.load, flat, checkpoint_id=path, **self._dcp_kwargs())
            if tied_alias and self.model_args.tie_embeddings and full:
                # the same count of calls on every rank
                _dcp(restricted_unpickle.load, aliased, checkpoint_id=path, **self._dcp_kwargs())
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure into
            # one CheckpointException (a BaseException), raised on every rank; its last line is the root cause
            if fault.is_comm_failure(e):  # a rank stopped answering: not the checkpoint's fault (reported by _op)
                raise
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"checkpoint '{path}' could not be loaded ({first}); move it out of its folder to "
                f"resume from the checkpoint before it, or repair it"
            ) from None
        flat, aliased = restore_layout(flat, originals), restore_layout(aliased, originals)
        for k, v in aliased.items():
            flat[k.replace(".tok_embeddings.weight.", ".output.weight.", 1)] = v
        model_sd = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
        set_model_state_dict(self.model, model_sd)
        if not full:
            return
        optim_sd = {k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")}
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=_OPTIM_OPTIONS)
        from titanlike.data import set_loader_position

        self.train_state.load_state_dict({k: flat[f"train.{k}"] for k in ("step", "tokens_seen", "nonfinite_steps")})
        set_loader_position(self.dataloader, flat["train.data_position"])
        sched = {k[len("train.lr_scheduler.") :]: v for k, v in flat.items() if k.startswith("train.lr_scheduler.")}
        self.lr_scheduler.load_state_dict(sched)
        if rng:
            torch.set_rng_state(flat[f"rng.rank{self.rank}.cpu"])
            if f"rng.rank{self.rank}.cuda" in flat:
                torch.cuda.set_rng_state(flat[f"rng.rank{self.rank}.cuda"], self.device)

    def _load_hf(self, path: str) -> None:
        from titanlike.hf import load_hf

        mine = get_model_state_dict(self.model)  # this rank's FQNs (a pipeline rank holds only its stages')
        dtype = next(iter(mine.values())).dtype  # the file may be bfloat16 / float16: cast to the parameters'
        full, _ = load_hf(path, self.model_args, dtype=dtype)
        set_model_state_dict(self.model, {k: full[k] for k in mine}, options=StateDictOptions(full_state_dict=True))

    # ------------------------------------------------------------------------------------------ save
    def maybe_save(self, step: int, last: bool = False) -> None:
        """Call after every step: commits a finished async save, saves at every ``interval`` and the last step."""
        self._poll()
        if self.cfg.enable and (step % self.cfg.interval == 0 or last) and step != self.last_step:
            if last and self.cfg.last_save_model_only:
                self.save(step, model_only=True)
            else:
                self.save(step)

    def save(self, step: int, model_only: bool = False) -> None:
        """Save step ``step``; ``model_only`` (checkpoint.last_save_model_only at the last step): the model weights
        only, cast to checkpoint.export_dtype (torchtitan's last save)."""
        self._wait()
        t0 = time.perf_counter()
        what = f"the checkpoint save of step {step}"
        with self._op(what):
            if self.distributed:
                self._barrier(what)
            if model_only:
                dtype = getattr(torch, self.cfg.export_dtype)
                state = {
                    "model": {k: v.to(dtype) for k, v in get_model_state_dict(self.model).items()},
                    "optimizer": {},
                }
                meta = _meta(
                    step,
                    "model_only",
                    self.model_args,
                    world_size=self.world_size,
                    dtype=self.cfg.export_dtype,
                    **tokenizer_meta(self.tokenizer),
                )
                self._check_finite(state, step)
                state = {"model": state["model"]}
            else:
                state = self._state()
                self._check_finite(state, step)
                train = state["train"]
                meta = _meta(
                    step,
                    "full",
                    self.model_args,
                    world_size=self.world_size,
                    dp_degree=self.dp_degree,
                    optimizer=self.optimizer_name,
                    tokens_seen=train["tokens_seen"],
                    data_position=train["data_position"],
                    nonfinite_steps=train["nonfinite_steps"],
                    **tokenizer_meta(self.tokenizer),
                )
            tmp = self.folder / f"step-{step}.tmp-{self.plan['run_id']}"
            kwargs = {**self._dcp_kwargs(), "checkpoint_id": str(tmp)}
            if self.cfg.checksum:
                kwargs["storage_writer"] = ChecksummingWriter(str(tmp))
            try:
                if self.cfg.async_mode == "async":
                    future = _dcp(dcp.async_save, state, **kwargs)
                    future = getattr(future, "upload_completion", future)  # AsyncSaveResponse on some stagers
                else:
                    _dcp(dcp.save, state, **kwargs)
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raises its gathered failures
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(step, tmp, e)
        if self.cfg.async_mode == "async":
            self.pending = (future, step, tmp, t0, meta)
            if self.rank == 0:
                print(
                    f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f}s, writing in the background",
                    flush=True,
                )
        else:
            self._commit(step, tmp, t0, meta)

    def _save_failed(self, step: int, tmp: Path, exc: BaseException):
        """A save that could not be written (disk full, I/O error, ...): remove its temporary folder (rank 0; DCP
        raises the failure of any rank on every rank, after all of them stopped writing) and stop the run with one
        line naming the folder and the free space. The previous checkpoint was never touched."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = max(committed_checkpoints(self.folder), default=None)
        previous = f"step-{newest} is intact" if newest is not None else "there is no earlier checkpoint"
        raise CheckpointSaveError(
            f"rank {self.rank}: the checkpoint save of step {step} into '{self.folder}' failed ({_root_cause(exc)}); "
            f"{fault.free_space(self.folder)} there; removed its partial folder {tmp.name}, {previous}"
        ) from exc

    def _barrier(self, what: str) -> None:
        """A barrier that names the ranks which do not arrive within comm.timeout_seconds (instead of hanging)."""
        try:
            dist.monitored_barrier(group=self.pg, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise fault.CollectiveFailure(
                f"rank {self.rank}: {what} did not start on every rank: {fault.first_line(e)}"
            ) from None

    def _check_finite(self, state: dict, step: int) -> None:
        local = [t for t in _local_tensors({"m": state["model"], "o": state["optimizer"]}) if t.numel()]
        # A sum is non-finite when an element is (10x faster than isfinite on every element); a finite tensor whose
        # sum overflows is told apart by the exact check, run only on the suspects.
        sums = torch.stack([t.sum().float() for t in local]).cpu() if local else torch.zeros(0)
        suspects = [t for t, s in zip(local, sums) if not torch.isfinite(s)]
        ok = torch.tensor([all(bool(torch.isfinite(t).all()) for t in suspects)], dtype=torch.int32)
        if self.distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.pg)
        if not ok.item():
            raise RuntimeError(
                f"step {step}: the model or optimizer state holds non-finite values; not saving a "
                f"checkpoint from it (the previous one, if any, is intact)"
            )

    def _poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self._wait()

    def _wait(self) -> None:
        if self.pending is None:
            return
        future, step, tmp, t0, meta = self.pending
        self.pending = None
        with self._op(f"the background checkpoint save of step {step}"):
            try:
                future.result()
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(step, tmp, e)
        self._commit(step, tmp, t0, meta)

    def _commit(self, step: int, tmp: Path, t0: float, meta: dict) -> None:
        """Rank 0 publishes a fully written checkpoint folder by renaming it, then purges old ones.

        When DCP returns (or its future resolves), the coordinator has written ``.metadata``, which it does only
        after every rank reported its data files written: no barrier is needed before the rename.
        """
        self.last_step = step
        if self.rank != 0:
            return
        try:
            _write_json(tmp / META_NAME, meta)
            if self.cfg.checksum:
                _merge_checksums(tmp)
        except OSError as e:
            self._save_failed(step, tmp, e)
        final = self.folder / f"step-{step}"
        if final.exists():  # not there at the start (_tidy): another job writes into this folder
            aside = final.with_name(f"{final.name}.replaced-{self.plan['run_id']}")
            os.rename(final, aside)
            print(f"checkpoint: {final} appeared while this run was training; set aside as {aside.name}", flush=True)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        size = sum(f.stat().st_size for f in final.iterdir()) / 2**20
        print(
            f"checkpoint: saved step {step} to {final} ({size:.1f} MiB) in {time.perf_counter() - t0:.2f}s", flush=True
        )
        self._purge()

    def _purge(self) -> None:
        """Delete checkpoints beyond keep_latest_k (oldest first) and leftovers of killed saves."""
        run_id = self.plan["run_id"]
        found = committed_checkpoints(self.folder)
        if self.cfg.keep_latest_k > 0:
            for step in list(found)[: -self.cfg.keep_latest_k]:
                _remove_dir(found[step], run_id)
        for p in self.folder.iterdir():
            if p.is_dir() and _LEFTOVER_DIR.fullmatch(p.name) and _only_ours(p):
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ end
    def finish(self) -> None:
        """Wait for an async save; with export_safetensors, rank 0 writes ``<folder>/final`` from the newest one."""
        self._wait()
        if self.cfg.export_safetensors and self.rank == 0 and self.last_step is not None:
            t0 = time.perf_counter()
            out, run_id = self.folder / "final", self.plan["run_id"]
            new = export_hf(
                self.folder / f"step-{self.last_step}",
                out.with_name(f"final.new-{run_id}"),
                dtype=getattr(torch, self.cfg.export_dtype),
            )
            if out.exists():  # a previous run's export of an older step: replace it
                _remove_dir(out, run_id)
            os.rename(new, out)
            print(
                f"checkpoint: exported step {self.last_step} as Hugging Face Llama to {out} in "
                f"{time.perf_counter() - t0:.2f}s",
                flush=True,
            )
        if self.distributed:
            with self._op("the end-of-training barrier"):
                dist.barrier(group=self.pg)
