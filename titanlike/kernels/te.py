"""Swap NVIDIA Transformer Engine (TE) modules into the plain model, keeping parameter names and shapes.

What is swapped, in every block of the model's block container and its output modules (the final norm), for a
model whose spec declares a TE-swappable norm (``ModelSpec.te_norm``; the layout rules refuse ``model.kernels=te``
for the others):

* instances of that norm class (an RMSNorm with ``weight`` and ``eps``) -> ``te.RMSNorm`` (parameter ``weight``,
  same semantics: ``zero_centered_gamma=False``);
* ``nn.Linear`` (Llama's ``wq/wk/wv/wo``, ``w1/w2/w3``) -> ``te.Linear`` (parameter ``weight``, shape (out, in)).

Parameter names, shapes and values are unchanged, so optimizers, the numerics gate (which compares by name),
checkpoints and the TP/FSDP plans see the same model. TE modules add one non-parameter entry per module to
the state dict, ``<module>._extra_state`` (FP8 scaling metadata); :func:`te_to_torch_state_dict` drops those
entries (a TE-trained checkpoint then loads strictly into the plain model) and
:func:`torch_to_te_state_dict` adds the TE model's own entries (a plain checkpoint then loads strictly into
the TE model). DCP loads a TE checkpoint into a plain model directly (it reads only the keys the destination
asks for).

Not swapped, deliberately:

* the output head and the embedding stay torch (the head's vocab matmul is kept out of FP8 for accuracy, as
  in torchtitan's float8 filter, and may be tied to the embedding);
* ``attention_norm`` + ``wq/wk/wv`` are not fused into ``te.LayerNormLinear`` nor ``ffn_norm`` + ``w1/w3/w2``
  into ``te.LayerNormMLP``: those fuse q/k/v (and w1/w3) into one weight, which changes names and shapes and
  breaks the column-wise TP plan, and would require a different block forward;
* attention stays ``F.scaled_dot_product_attention`` (FlashAttention / cuDNN attention on CUDA): using
  ``te.DotProductAttention`` needs a different ``Attention.forward``.

FP8: ``float8_recipe`` ``delayed`` | ``current`` | ``block`` | ``mxfp8`` maps to ``DelayedScaling`` /
``Float8CurrentScaling`` / ``Float8BlockScaling`` / ``MXFP8BlockScaling`` with TE's defaults, and the model's
forward then runs under TE's FP8 autocast (``te.autocast``, or ``te.fp8_autocast`` on older TE); the backward
needs no context. Hardware floors (TE's own): FP8 needs compute capability 8.9, block scaling 9.0, MXFP8 10.0.

Limits: TE modules are not ``nn.Linear``, so the torch TP plans do not apply: ``model.kernels=te`` needs
``tensor_parallel_degree=1`` (FSDP, PP, AC and compile are fine; compile graph-breaks around TE kernels, see
``titanlike.parallel.compile``). With the ``delayed`` recipe, activation checkpointing recomputes TE forwards
outside TE's own ``te.checkpoint``, so amax histories see the recomputation too; prefer ``current``/``block``/
``mxfp8`` with AC. The TE kernels themselves only run on CUDA with TE installed; on CPU only the conversion
logic is tested, with a stand-in namespace (``tests/kernels/test_te_convert.py``).
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlike.layout.float8 import TE_FLOAT8_RECIPES
from titanlike.models import block_container_of, spec_for

__all__ = [
    "TEUnavailableError",
    "load_te",
    "te_available",
    "make_fp8_recipe",
    "convert_to_te",
    "convert_kernels",
    "te_to_torch_state_dict",
    "torch_to_te_state_dict",
    "FP8_RECIPES",
]

EXTRA_STATE = "_extra_state"

# recipe name (titanlike.layout.TE_FLOAT8_RECIPES, in its order) -> (TE recipe class name, minimum compute capability,
# what it is)
FP8_RECIPES: dict[str, tuple[str, tuple[int, int], str]] = dict(
    zip(
        TE_FLOAT8_RECIPES,
        (
            ("DelayedScaling", (8, 9), "per-tensor delayed scaling"),  # delayed
            ("Float8CurrentScaling", (8, 9), "per-tensor current scaling"),  # current
            ("Float8BlockScaling", (9, 0), "1x128 / 128x128 block scaling"),  # block
            ("MXFP8BlockScaling", (10, 0), "MXFP8 (1x32 blocks, Blackwell)"),  # mxfp8
        ),
        strict=True,
    )
)
# FP8 GEMMs need both matrix dims to be multiples of this (MXFP8: 32-element blocks).
_FP8_ALIGN = {"mxfp8": 32}


class TEUnavailableError(RuntimeError):
    """``model.kernels=te`` was asked for where Transformer Engine cannot be imported."""


def _import_te(import_module: Callable[[str], types.ModuleType]) -> types.SimpleNamespace:
    """The TE pieces the converter uses, as one namespace (the shape test stand-ins copy)."""
    te = import_module("transformer_engine.pytorch")
    recipe = import_module("transformer_engine.common.recipe")
    return types.SimpleNamespace(
        Linear=te.Linear,
        RMSNorm=te.RMSNorm,
        autocast=getattr(te, "autocast", None),
        fp8_autocast=getattr(te, "fp8_autocast", None),
        recipe=recipe,
    )


@functools.cache
def _cached_te() -> types.SimpleNamespace | str:
    try:
        return _import_te(importlib.import_module)
    except Exception as e:  # TE raises ImportError, OSError (no libcuda.so.1), RuntimeError (no GPU), ...
        return f"{type(e).__name__}: {' '.join(str(e).split())}"


def load_te(import_module: Callable[[str], types.ModuleType] | None = None) -> types.SimpleNamespace:
    """Import Transformer Engine, or raise :class:`TEUnavailableError` with one line saying why and what to do."""
    if import_module is None:
        result = _cached_te()
    else:
        try:
            result = _import_te(import_module)
        except Exception as e:
            result = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if isinstance(result, str):
        raise TEUnavailableError(
            f"model.kernels=te needs NVIDIA Transformer Engine, which cannot be imported here ({result}); "
            f"install transformer-engine[pytorch] on a CUDA machine or use model.kernels=torch"
        )
    return result


def te_available() -> bool:
    return not isinstance(_cached_te(), str)


def make_fp8_recipe(name: str, recipe_module, capability: tuple[int, int] | None):
    """The TE recipe object for ``float8.recipe`` ``name`` ("" -> None), checked against the GPU's
    ``capability`` (None: no GPU)."""
    if not name:
        return None
    if name not in FP8_RECIPES:
        raise ValueError(f"float8.recipe must be one of {', '.join(FP8_RECIPES)} or empty, got {name!r}")
    cls_name, floor, what = FP8_RECIPES[name]
    if capability is None:
        raise ValueError(f"float8.recipe={name} needs a CUDA GPU (compute capability >= {floor[0]}.{floor[1]})")
    if tuple(capability) < floor:
        raise ValueError(
            f"float8.recipe={name} ({what}) needs compute capability >= {floor[0]}.{floor[1]}, "
            f"this GPU has {capability[0]}.{capability[1]}"
        )
    return getattr(recipe_module, cls_name)()


def _current_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _new_linear(te, old: nn.Linear) -> nn.Module:
    w = old.weight
    new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None, params_dtype=w.dtype, device=w.device)
    _copy_params(old, new)
    return new


def _new_rmsnorm(te, old: nn.Module) -> nn.Module:
    w = old.weight
    new = te.RMSNorm(w.shape[0], eps=old.eps, params_dtype=w.dtype, device=w.device)
    _copy_params(old, new)
    return new


@torch.no_grad()
def _copy_params(old: nn.Module, new: nn.Module) -> None:
    new_params = dict(new.named_parameters())
    for name, p in old.named_parameters():
        q = new_params[name]
        if q.shape != p.shape:
            raise RuntimeError(
                f"TE module {type(new).__name__}.{name} has shape {tuple(q.shape)}, expected {tuple(p.shape)}"
            )
        if p.device.type != "meta":
            q.copy_(p)
        q.requires_grad_(p.requires_grad)


def _swap_children(module: nn.Module, te, norm_cls: type, prefix: str, converted: list[str]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            setattr(module, name, _new_linear(te, child))
            converted.append(path)
        elif isinstance(child, norm_cls):
            setattr(module, name, _new_rmsnorm(te, child))
            converted.append(path)
        else:
            _swap_children(child, te, norm_cls, f"{path}.", converted)


class _FP8Autocast:
    """Mixed into the root module's class: its forward runs under TE's FP8 autocast."""

    def forward(self, *args, **kwargs):
        with self._te_fp8_context():
            return super().forward(*args, **kwargs)


@functools.cache
def _fp8_class(cls: type) -> type:
    return type(f"FP8{cls.__name__}", (_FP8Autocast, cls), {"__module__": cls.__module__})


def _fp8_context_factory(te, recipe, group) -> Callable:
    if te.autocast is not None:
        return functools.partial(te.autocast, enabled=True, recipe=recipe, amax_reduction_group=group)
    return functools.partial(te.fp8_autocast, enabled=True, fp8_recipe=recipe, fp8_group=group)


def convert_to_te(
    model: nn.Module,
    float8_recipe: str = "",
    *,
    te: types.SimpleNamespace | None = None,
    capability: tuple[int, int] | None = None,
    fp8_group=None,
) -> nn.Module:
    """Swap TE modules into ``model`` (a registered model whose spec declares ``te_norm``, or a pipeline stage of
    one) in place; returns it.

    Call on the unparallelized model (materialised or on the meta device), before ``parallelize_model``.
    ``te``: the TE namespace (default: :func:`load_te`, which raises one clear error where TE can't load);
    ``capability``: the GPU's compute capability (default: the current CUDA device's); ``fp8_group``: the
    process group over which delayed scaling all-reduces amaxes (TE's default: the world).
    """
    spec = spec_for(model)
    if spec is None or spec.te_norm is None:
        raise ValueError(
            f"model.kernels=te: {type(model).__name__} declares no Transformer Engine swap (ModelSpec.te_norm); "
            f"use model.kernels=torch"
        )
    if te is None:
        te = load_te()
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "model.kernels=te must be applied before tensor parallelism / FSDP, and does not combine "
            "with tensor_parallel_degree > 1 (TE modules are not nn.Linear)"
        )
    if capability is None and float8_recipe:
        capability = _current_capability()
    recipe = make_fp8_recipe(float8_recipe, te.recipe, capability)
    if recipe is not None:
        align = _FP8_ALIGN.get(float8_recipe, 16)
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name != "output" and (m.in_features % align or m.out_features % align):
                raise ValueError(
                    f"float8.recipe={float8_recipe}: {name} is {m.in_features} -> {m.out_features}; "
                    f"FP8 GEMMs need both dims to be multiples of {align}"
                )
    converted: list[str] = []
    for name, block in block_container_of(model).named_children():
        _swap_children(block, te, spec.te_norm, f"{spec.block_container}.{name}.", converted)
    for name in spec.output_modules:
        if isinstance(getattr(model, name, None), spec.te_norm):
            setattr(model, name, _new_rmsnorm(te, getattr(model, name)))
            converted.append(name)
    if recipe is not None:
        model.__class__ = _fp8_class(type(model))
        model._te_fp8_context = _fp8_context_factory(te, recipe, fp8_group)
        model._te_fp8_recipe = recipe
    model._te_converted = tuple(converted)
    return model


def convert_kernels(model: nn.Module, kernels: str, float8_recipe: str = "", **kwargs) -> nn.Module:
    """``model.kernels`` dispatch: ``torch`` leaves the model as is, ``te`` calls :func:`convert_to_te`."""
    if kernels == "torch":
        if float8_recipe:
            raise ValueError(f"float8.recipe={float8_recipe} needs model.kernels=te")
        return model
    if kernels == "te":
        return convert_to_te(model, float8_recipe, **kwargs)
    raise ValueError(f"model.kernels must be torch or te, got {kernels!r}")


def _is_extra_state(key: str) -> bool:
    return key == EXTRA_STATE or key.endswith("." + EXTRA_STATE)


def te_to_torch_state_dict(state_dict: dict) -> dict:
    """A TE model's state dict as the plain model's: the same entries without TE's ``_extra_state``."""
    return {k: v for k, v in state_dict.items() if not _is_extra_state(k)}


def torch_to_te_state_dict(state_dict: dict, te_model: nn.Module) -> dict:
    """A plain model's state dict completed with ``te_model``'s own ``_extra_state`` entries (fresh FP8
    metadata), so that ``te_model.load_state_dict(..., strict=True)`` accepts it."""
    out = dict(state_dict)
    for k, v in te_model.state_dict().items():
        if _is_extra_state(k):
            out.setdefault(k, v)
    return out
