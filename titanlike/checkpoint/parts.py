"""The model parts of a rank as one state dict with the plain model's names: any-module ``save_parts`` /
``load_parts``, the view over several pipeline stages, the one-process reader, and the checks of a checkpoint's
model entries against a model (names, shapes, tied parameters)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlike import fault
from titanlike.checkpoint.checksums import CorruptCheckpointError, check_files, load_verified, read_checksums
from titanlike.checkpoint.files import quiet_dcp, read_dcp_metadata
from titanlike.errors import ConfigError

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelPartsView(nn.Module):
    """One module whose parameters are those of several model parts under their plain-model FQNs.

    Under pipeline parallelism a rank holds several stages (``titanlike.parallel.pipeline.build_stage``), each with
    FQNs of the full model; their top-level children with state are disjoint except the block container (a
    ``ModuleDict`` or a pruned ``ModuleList``), whose entries are merged (stateless children, which every stage
    keeps, are left out). The view only
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
            if next(child.parameters(), None) is None and next(child.buffers(), None) is None:
                continue  # no state (a stateless child every stage keeps, e.g. the decoder's position seam)
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
            elif have is not child:
                raise ValueError(f"model parts both hold '{name}'")


def merged_model(parts: Sequence[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else ModelPartsView(parts)


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict as one level of dotted keys (``{"model": {"w": t}}`` -> ``{"model.w": t}``)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------------- any module
def _parts_state(model: nn.Module, optimizer) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS)
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
    quiet_dcp(dcp.save, state, checkpoint_id=str(path), **kwargs)


def load_parts(
    path: str | os.PathLike, model_parts: Sequence[nn.Module], optimizer=None, *, process_group=None
) -> None:
    """Load a :func:`save_parts` folder (written under any layout) into this rank's ``model_parts`` (and the
    optimizer's state), in place. Executes nothing from the files (``restricted_unpickle``)."""
    from titanlike.parallel.fused import contiguous_for_dcp, restore_layout

    model = merged_model(list(model_parts))
    originals = flatten(_parts_state(model, optimizer))
    flat = contiguous_for_dcp(originals)
    kwargs = {"process_group": process_group} if dist.is_initialized() else {"no_dist": True}
    quiet_dcp(load_verified, flat, path, verified_records(path), **kwargs)
    flat = restore_layout(flat, originals)
    set_model_state_dict(model, {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")})
    if optimizer is not None:
        set_optimizer_state_dict(
            model,
            optimizer,
            {k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")},
            options=OPTIM_OPTIONS,
        )


# ---------------------------------------------------------------------------------------------------- one process
def read_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint folder written under any layout, read in this process."""
    metadata = read_dcp_metadata(path)
    sd = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            sd[key[len("model.") :]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not sd:
        raise ConfigError(f"checkpoint '{path}' holds no model weights; is it a titanlike checkpoint?")
    try:
        quiet_dcp(load_verified, {"model": sd}, path, verified_records(path), no_dist=True)
    except dcp.CheckpointException as e:
        corrupt = fault.failure_of(e, CorruptCheckpointError)
        if corrupt is None:
            raise
        raise ConfigError(f"checkpoint '{path}' is corrupted: {corrupt}") from None
    return sd


def verified_records(path: str | os.PathLike) -> dict | None:
    """The per-entry checksums a one-process read of ``path`` compares (None: none recorded), after checking the
    files' sizes and whole-file checksums; ConfigError when they do not match."""
    sums = read_checksums(path)
    problem = sums if isinstance(sums, str) else check_files(path, sums) if sums is not None else None
    if problem:
        raise ConfigError(f"checkpoint '{path}' is corrupted: {problem}")
    return None if sums is None else sums.records or None


# ---------------------------------------------------------------------------------------------------- checks
def check_model_fits(metadata, expected: dict[str, torch.Size], path: str | os.PathLike, args=None) -> None:
    """ConfigError unless the checkpoint's ``model.*`` entries are exactly the model's FQNs with its shapes. With
    ``args`` (this run's model), a checkpoint whose checkpoint.json records another model is refused naming it."""
    saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    if not saved:
        raise ConfigError(f"checkpoint '{path}' holds no model weights; is it a titanlike checkpoint?")
    if args is not None:
        _check_same_model(path, args)
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


def _check_same_model(path, args) -> None:
    """A checkpoint whose checkpoint.json names another registered model than ``args``': one line naming both."""
    from titanlike.checkpoint.meta import read_meta
    from titanlike.models import spec_for

    theirs, ours = read_meta(path).get("model"), spec_for(args)
    if theirs is not None and ours is not None and theirs != ours.name:
        raise ConfigError(
            f"checkpoint '{path}' holds a {theirs} model (its checkpoint.json) and this run builds {ours.name} "
            f"(model.name); set model.name = {theirs}, or use another checkpoint.folder / job.dump_folder"
        )


# ---------------------------------------------------------------------------------------------------- ties
def tied_pairs(model_args) -> tuple[tuple[str, str], ...]:
    """``(owner, copy)`` FQNs of the parameters that are one parameter of the model of ``model_args`` (a registered
    model's args), found by identity on its meta model (``titanlike.parallel.ties.tie_groups``, the one tie helper);
    none for args no registered model has."""
    from titanlike.models import spec_for
    from titanlike.parallel.ties import tie_groups

    spec = spec_for(model_args)
    if spec is None:
        return ()
    return tuple((names[0], copy) for names in tie_groups(spec.build_meta(model_args)) for copy in names[1:])


def _copy_prefixes(pairs) -> list[tuple[str, str]]:
    return [
        (f"optimizer.{part}.{copy}.", f"optimizer.{part}.{owner}.")
        for owner, copy in pairs
        for part in ("state", "param_groups")
    ]


def owner_key(key: str, pairs) -> str | None:
    """The optimizer-state key of a tied parameter's owner for one of its copy (``pairs``: :func:`tied_pairs`),
    else None.

    A tied model saved without pipelining has one parameter under two names, and the flattened optimizer state
    lists it once, under the owner (``tok_embeddings.weight``); a last pipeline stage holds its own copy of it
    (``output.weight``), whose state is loaded from the owner's.
    """
    for copy_prefix, owner_prefix in _copy_prefixes(pairs):
        if key.startswith(copy_prefix):
            return owner_prefix + key[len(copy_prefix) :]
    return None


def holds_copy_state(keys, pairs) -> bool:
    """True when a checkpoint's keys hold optimizer state of its own for a tied copy (it was written by a pipeline
    whose stages each held a copy), so no copy needs the owner's."""
    prefixes = [p for p, _ in _copy_prefixes(pairs) if p.startswith("optimizer.state.")]
    return any(k.startswith(p) for k in keys for p in prefixes)
