"""The one pipeline stage builder: a copy of the full model holding only a stage's modules, with its FQNs.

torchtitan's ``module_fqns_per_model_part`` idea, for any ``nn.Module`` (titanlike's registered models and a
user's own alike): the stage is the model with the other stages' modules removed, children set to ``None`` and
entries of an ``nn.ModuleDict`` / ``nn.ModuleList`` deleted (a container left with no entries stays, empty; the
other entries keep their keys, hence the FQNs:
``layers.5.attention.wq.weight`` on every layout, so checkpoints load across pipeline layouts). The model's forward
must skip ``None`` modules and take hidden states when its input modules are gone (the contract
``titanlike.models.decoder.Decoder`` implements). Children that hold no parameters and no buffers (a dropout, an
activation, the decoder's position seam) are kept on every stage: they cost nothing and the forward may call them.

On the meta device (the trainer's way) the stage stays on meta, to be parallelized there and then allocated and
filled by ``titanlike.parallel.materialize``; a materialised model gives a stage holding copies of its values
(never shared storage: two stages of a rank must not alias a tied weight, or the optimizer would update it twice).
"""

from __future__ import annotations

import copy
import linecache
import re
from collections.abc import Sequence

import torch
from torch import nn

from titanlike.parallel.ties import tie_groups

__all__ = ["build_stage", "check_split", "dry_run", "module_owner"]


def module_owner(fqns: Sequence[str], name: str) -> str | None:
    """The listed module FQN that holds parameter ``name`` (a prefix of it), or None."""
    for fqn in fqns:
        if name == fqn or name.startswith(fqn + "."):
            return fqn
    return None


def _stateless(module: nn.Module) -> bool:
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def check_split(model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]], shared: Sequence[str] = ()) -> None:
    """Every listed FQN (``shared``: the modules every stage holds) is a module of ``model``, listed once; every
    parameter lies in exactly one listed module (under one of its names: tied parameters may be listed on several
    stages). Raises ValueError naming them all."""
    problems = []
    modules = dict(model.named_modules())
    flat = [f for stage in module_fqns_per_stage for f in stage] + list(shared)
    if len(module_fqns_per_stage) < 2 or any(not stage for stage in module_fqns_per_stage):
        problems.append("give at least 2 stages, none of them empty")
    unknown = [f for f in flat if f not in modules or f == ""]
    if unknown:
        problems.append(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a submodule of {type(model).__name__}"
        )
    twice = sorted({f for f in flat if flat.count(f) > 1})
    if twice:
        problems.append(f"{', '.join(twice)} listed more than once")
    nested = sorted({a for a in flat for b in flat if a != b and a.startswith(b + ".")})
    if nested:
        problems.append(f"{', '.join(nested)} inside another listed module")
    tied = {name: names for names in tie_groups(model) for name in names}
    orphans = [
        name for name, _ in model.named_parameters() if not any(module_owner(flat, n) for n in tied.get(name, [name]))
    ]
    if orphans:
        problems.append(f"parameter(s) {', '.join(orphans[:6])} in no listed module")
    if problems:
        raise ValueError(
            f"pipeline split of {type(model).__name__}: " + "; ".join(problems) + "; list module FQNs "
            "(model.named_modules()) per stage so that every parameter is in exactly one (shared=[...]: the modules "
            "every stage calls)"
        )


def build_stage(model: nn.Module, fqns: Sequence[str], *, meta: bool = False) -> nn.Module:
    """A copy of ``model`` holding only the modules ``fqns`` (and its stateless children); see the module docstring.

    Only what the stage keeps is copied (one ``deepcopy`` whose memo maps every dropped module to None), not the
    whole model per stage: a stage of a large model costs its own share of the memory. ``meta=True``: the copy's
    parameters and buffers are on the meta device (nothing is copied; ties kept), for :func:`dry_run`."""
    keep = set(fqns)
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = {id(m) for fqn in keep for m in modules[fqn].modules()}
    memo: dict = {}
    if meta:
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
    dropped: list[tuple[str, str]] = []  # (owner FQN, child name)

    def drop(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in keep or _stateless(child):
                continue
            # a container none of whose entries the stage keeps stays, empty (torchtitan's way): a stage of no block
            # (the embedding or the head alone, an uneven split) still loops over its block container
            if any(k.startswith(fqn + ".") for k in keep) or isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                drop(child, fqn + ".")
            else:
                dropped.append((prefix[:-1], name))
                if id(child) not in kept:  # (a module also reachable under a kept name is copied, once)
                    memo[id(child)] = None  # deepcopy puts None there instead of copying it

    drop(model, "")
    stage = copy.deepcopy(model, memo)
    for owner_fqn, name in dropped:
        owner = stage.get_submodule(owner_fqn)
        if isinstance(owner, (nn.ModuleDict, nn.ModuleList)):
            del owner._modules[name]  # the other keys (FQNs) stay as they are
        else:
            setattr(owner, name, None)
    return stage


def _frames(exc: BaseException) -> list:
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _dropped_dict_entry(exc: BaseException, stage: nn.Module, model: nn.Module) -> tuple[str, str, str] | None:
    """(the FQN, the owner's FQN, the source line) of an entry of an ``nn.ModuleDict`` that the stage dropped (deleted:
    the other keys keep their FQNs) and a forward reached by attribute (``self.transformer.wte``, nanoGPT's way)."""
    m = re.fullmatch(r"'ModuleDict' object has no attribute '(\w+)'", str(exc))
    if not isinstance(exc, AttributeError) or m is None:
        return None
    names = {id(mod): n for n, mod in stage.named_modules(remove_duplicate=False)}
    frames = _frames(exc)
    for i in reversed(range(len(frames))):
        owner = frames[i][0].f_locals.get("self")
        if not isinstance(owner, nn.ModuleDict) or id(owner) not in names:
            continue
        prefix = names[id(owner)]
        if m.group(1) not in model.get_submodule(prefix)._modules:
            return None  # not an entry the stage dropped: the forward's own error
        caller = next((f, n) for f, n in reversed(frames[:i]) if isinstance(f.f_locals.get("self"), nn.Module))
        line = linecache.getline(caller[0].f_code.co_filename, caller[1]).strip()
        return (f"{prefix}.{m.group(1)}" if prefix else m.group(1)), prefix, line
    return None


def _none_child(exc: BaseException, stage: nn.Module) -> tuple[str, str, str] | None:
    """(the FQN of the ``None`` child, the owner's FQN, the source line) that a forward failed on, from the frames of
    ``exc``: the innermost frame whose ``self`` is a module of ``stage`` holding a ``None`` child named in its
    line."""
    if not isinstance(exc, (TypeError, AttributeError)) or "NoneType" not in str(exc):
        return None
    names = {id(m): n for n, m in stage.named_modules(remove_duplicate=False)}
    frames = _frames(exc)
    for frame, lineno in reversed(frames):
        owner = frame.f_locals.get("self")
        if not isinstance(owner, nn.Module) or id(owner) not in names:
            continue
        line = linecache.getline(frame.f_code.co_filename, lineno).strip()
        nones = [n for n, c in owner._modules.items() if c is None]
        named = [n for n in nones if re.search(rf"\b{re.escape(n)}\b", line)] or nones
        if named:
            prefix = names[id(owner)]
            return (f"{prefix}.{named[0]}" if prefix else named[0]), prefix, line
    return None


def _meta_forward(stage: nn.Module, x):
    """``stage(x)`` on the meta device. A data-dependent check (``.item()``) cannot run on meta tensors: that stage
    runs again on fake tensors (meta-backed), whose checks libraries skip (transformers' ``is_tracing`` does, with
    ``use_cache=False``); its output is handed on as meta tensors."""
    with torch.no_grad():
        try:
            return stage(x)
        except RuntimeError as exc:
            if "meta tensors" not in str(exc):
                raise
        from torch._subclasses.fake_tensor import FakeTensorMode  # torch's fake tensors (every supported torch)

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = stage(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor):
            return out
        return torch.empty(first.shape, dtype=first.dtype, device="meta")


def dry_run(
    model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]], example_input: torch.Tensor | None = None
) -> None:
    """Run every stage's forward on the meta device, each on the previous stage's output (the first on
    ``example_input``, default ``(1, 4)`` token ids), so that a forward calling a child that is ``None`` on its stage
    is a one-line error here, on every rank alike, naming the child and the fix, instead of ``'NoneType' object is
    not callable`` on one rank in the first step while the others wait for the timeout. A forward that cannot run on
    meta (a data-dependent branch) ends the dry run there, unjudged: only the ``None`` calls are refused."""
    x = torch.zeros(1, 4, dtype=torch.long) if example_input is None else example_input
    x = x.to("meta")
    where = {f: s for s, fqns in enumerate(module_fqns_per_stage) for f in fqns}
    for s, fqns in enumerate(module_fqns_per_stage):
        stage = build_stage(model, fqns, meta=True)
        try:
            x = _meta_forward(stage, x)
        except Exception as exc:  # noqa: BLE001 - only the calls of children the stage lacks are judged
            none = _none_child(exc, stage)
            found = none or _dropped_dict_entry(exc, stage, model)
            if found is None:
                return
            child, owner, line = found
            on = f"on stage {where[child]}" if child in where else "listed on no stage"
            leaf = child.rpartition(".")[2]
            if none is not None:
                what, skip = "None", f"skip None children in the forward (if self.{leaf} is not None: ...)"
            else:
                what = f"not in its ModuleDict '{owner}' (the stage deletes the entries of other stages)"
                skip = f"skip absent entries in the forward (if '{leaf}' in self.{owner.rpartition('.')[2]}: ...)"
            raise ValueError(
                f"pipeline_module: stage {s}'s forward calls '{child}' ({line!r}), which is {on}, so it is {what} "
                f"on stage {s}; {skip}, or, if every stage needs it (rotary or position tables), pass "
                f"shared=['{child}']"
            ) from None
        if isinstance(x, (tuple, list)):
            x = x[0]
        if not isinstance(x, torch.Tensor):
            return
