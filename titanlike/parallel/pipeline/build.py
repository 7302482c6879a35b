"""The one pipeline stage builder: a copy of the full model holding only a stage's modules, with its FQNs.

torchtitan's ``module_fqns_per_model_part`` idea, for any ``nn.Module`` (titanlike's registered models and a
user's own alike): the stage is the model with the other stages' modules removed, children set to ``None`` and
entries of an ``nn.ModuleDict`` / ``nn.ModuleList`` deleted (their keys, hence the FQNs, are kept:
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
from collections.abc import Sequence

from torch import nn

from titanlike.parallel.ties import tie_groups

__all__ = ["build_stage", "check_split", "module_owner"]


def module_owner(fqns: Sequence[str], name: str) -> str | None:
    """The listed module FQN that holds parameter ``name`` (a prefix of it), or None."""
    for fqn in fqns:
        if name == fqn or name.startswith(fqn + "."):
            return fqn
    return None


def _stateless(module: nn.Module) -> bool:
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def check_split(model: nn.Module, module_fqns_per_stage: Sequence[Sequence[str]]) -> None:
    """Every listed FQN is a module of ``model``, listed once; every parameter lies in exactly one listed module
    (under one of its names: tied parameters may be listed on several stages). Raises ValueError naming them all."""
    problems = []
    modules = dict(model.named_modules())
    flat = [f for stage in module_fqns_per_stage for f in stage]
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
            "(model.named_modules()) per stage so that every parameter is in exactly one"
        )


def build_stage(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """A copy of ``model`` holding only the modules ``fqns`` (and its stateless children); see the module docstring.

    Only what the stage keeps is copied (one ``deepcopy`` whose memo maps every dropped module to None), not the
    whole model per stage: a stage of a large model costs its own share of the memory."""
    keep = set(fqns)
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = {id(m) for fqn in keep for m in modules[fqn].modules()}
    memo: dict = {}
    dropped: list[tuple[str, str]] = []  # (owner FQN, child name)

    def drop(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in keep or _stateless(child):
                continue
            if any(k.startswith(fqn + ".") for k in keep):
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
