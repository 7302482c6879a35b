"""Tied parameters, found and re-tied by identity: the one helper TP, FSDP, PP, materialize and the gate use.

A parameter is tied when the module reaches it under more than one name (``output.weight is
tok_embeddings.weight``, or any other sharing a user wrote). Nothing here reads a model's spec or a name list:
what is shared is what is one object. Transforms that give every module its own copy (``parallelize_module``,
``to_empty``) re-tie with :func:`retie`; the pipeline's stages, which each keep their own copy of a parameter
shared across stages, find those with :func:`tie_groups` on the full model before the split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["parameter_names", "retie", "tie_groups"]


def parameter_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter of ``module``, one list per parameter (by identity, in ``named_parameters``
    order; the first name is the one ``named_parameters()`` keeps)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return list(by_id.values())


def tie_groups(module: nn.Module) -> list[list[str]]:
    """The names of each parameter ``module`` reaches under more than one name (:func:`parameter_names` of more
    than one name)."""
    return [names for names in parameter_names(module) if len(names) > 1]


def retie(
    module: nn.Module,
    groups: Sequence[Sequence[str]],
    check: Callable[[str, nn.Parameter, str, nn.Parameter], None] | None = None,
) -> None:
    """Make each group of names one parameter again: the first name's (``check(first_name, first, name, p)`` may
    refuse a copy that cannot be the same parameter, e.g. another layout)."""
    for names in groups:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            p = module.get_parameter(name)
            if p is first:
                continue
            if check is not None:
                check(names[0], first, name, p)
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, first)
