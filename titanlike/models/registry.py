"""The model registry: the built-in models (one import line each) and the lookups the package uses.

A model package registers its :class:`~titanlike.models.spec.ModelSpec` when it is imported; this module imports
the built-in ones, so that ``model.name`` can select any of them. A model registered from outside the package
(a user's) only has to be imported before its name is used.
"""

from __future__ import annotations

from torch import nn

import titanlike.models.deepseek_v3  # noqa: F401
import titanlike.models.gpt2  # noqa: F401
import titanlike.models.gpt_oss  # noqa: F401
import titanlike.models.llama  # noqa: F401
import titanlike.models.qwen3  # noqa: F401
import titanlike.models.qwen3_moe  # noqa: F401
import titanlike.models.qwen3_next  # noqa: F401
import titanlike.models.transformers_lm  # noqa: F401
from titanlike.models.spec import _REGISTRY, ModelSpec, UnknownModelError, lookup

__all__ = ["DEFAULT_MODEL", "block_container_of", "get_spec", "registered", "spec_for"]

# The model a configuration without model.name, or a checkpoint written before checkpoints recorded their model,
# means.
DEFAULT_MODEL = "llama3"


def registered() -> list[str]:
    return sorted(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise UnknownModelError(f"model.name: unknown model '{name}'; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def spec_for(obj) -> ModelSpec | None:
    """The spec whose model or args class ``obj`` (a model, a pipeline stage, or its args) is an instance of."""
    return lookup(obj)


def block_container_of(model: nn.Module) -> nn.Module | None:
    """The container of ``model``'s blocks (keyed by global index): its spec's ``block_container`` for a registered
    model or a pipeline stage of one, ``.layers`` for any other module; None when it has none."""
    spec = spec_for(model)
    container = getattr(model, spec.block_container if spec is not None else "layers", None)
    return container if isinstance(container, nn.Module) else None
