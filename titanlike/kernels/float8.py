"""Float8 training through torchao (``float8.backend = "torchao"``), applied from outside the plain model.

:func:`convert_to_float8` swaps the model's ``nn.Linear`` layers for torchao's ``Float8Linear`` in place, on the
unparallelized model (materialised or on the meta device), before ``parallelize_model``. ``Float8Linear`` is an
``nn.Linear`` subclass that keeps the same ``weight`` parameter object, so parameter names, shapes, values and
therefore checkpoints are unchanged: a float8 run resumes without float8 and vice versa.

Which layers: of a registered model, those its sharding entries mark float8-eligible (``titanlike.sharding``:
Colwise / Rowwise entries with ``float8=True``; ``modules=`` patterns), of any other module every ``nn.Linear``;
of those, each whose fully qualified name contains none of ``float8.filter_fqns`` (default ``["output"]``: the
vocabulary head stays high precision, as torchtitan does) and whose two dims are multiples of 16 (the float8
GEMM's alignment; others stay in the run's dtype). A weight shared with another module (a tied head) is never
converted.

Recipes, as torchao names them (``Float8LinearConfig.from_recipe_name``):

* ``tensorwise``: one dynamic scale per tensor, e4m3 everywhere; the fastest, and the only one whose weights
  FSDP2 can all-gather in float8 (``float8.enable_fsdp_float8_all_gather``; then
  ``float8.precompute_float8_dynamic_scale_for_fsdp`` computes every weight's scale in one all-reduce after
  each optimizer step) and whose TP collectives run in float8 (``Float8ColwiseParallel`` /
  ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``);
* ``rowwise``: one scale per row, power-of-two scales, e4m3 (sm_90+ for the fast kernels);
* ``rowwise_with_gw_hp``: rowwise, with the weight-gradient GEMM kept in high precision.

``float8.emulate = true`` runs torchao's emulation (float8 casts, GEMMs in float32): the same numerics without a
float8-capable GPU, for CPU runs and tests. Without it torchao needs CUDA compute capability >= 8.9.

Workaround (torchao 0.18, torch 2.13): ``Float8Linear.forward`` applies the *CUDA* autocast dtype only
(``torch.is_autocast_enabled()`` / ``get_autocast_gpu_dtype()``), so under CPU autocast the saved input stays
float32 while the output gradient is bf16, and ``rowwise_with_gw_hp``'s high-precision weight-gradient GEMM
fails (``expected m1 and m2 to have the same dtype``). The converted modules get a one-method subclass that casts
the input to the autocast dtype of *its own* device first, then runs torchao's forward unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from collections.abc import Iterable

import torch
from torch import nn

from titanlike.layout.float8 import TORCHAO_FLOAT8_RECIPES
from titanlike.sharding import matches

__all__ = [
    "TORCHAO_RECIPES",
    "FLOAT8_ALIGN",
    "Float8UnavailableError",
    "load_torchao_float8",
    "torchao_available",
    "check_float8_runtime",
    "float8_linear_config",
    "float8_filter",
    "convert_to_float8",
    "is_float8_linear",
    "float8_tensorwise_tp",
    "precompute_float8_scales",
    "convert_experts_to_float8",
    "experts_float8_unavailable",
    "float8_grouped_mm",
]

TORCHAO_RECIPES = TORCHAO_FLOAT8_RECIPES  # the names are the layout layer's (config choices, rules, here)
FLOAT8_ALIGN = 16  # both GEMM dims multiples of 16 (torch._scaled_mm)
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: float8 tensor cores


class Float8UnavailableError(RuntimeError):
    """float8 through torchao was asked for where it cannot run; the message is one line naming the fix."""


@functools.cache
def _cached_torchao():
    # Importing torchao 0.18 logs a warning per CUDA extension it cannot load on a machine without CUDA ("Failed
    # to load .../_C_mxfp8...so") and torch 2.13 one about its KernelPreference enum: harmless for float8 training
    # (pure PyTorch + torch._scaled_mm), but they would bury one-line errors. Quiet those two loggers meanwhile.
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        torchao = importlib.import_module("torchao")
        f8 = importlib.import_module("torchao.float8")
        return torchao.__version__, f8
    except Exception as e:  # noqa: BLE001 - ImportError, or a torchao built for another torch: report either
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def load_torchao_float8():
    """``torchao.float8``, or :class:`Float8UnavailableError` with one line saying why and what to do."""
    result = _cached_torchao()
    if isinstance(result, str):
        raise Float8UnavailableError(
            f"float8.backend=torchao needs torchao, which cannot be imported here ({result}); "
            f"pip install 'torchao==0.18.0' (the project's [float8] extra) or leave float8.recipe empty"
        )
    return result[1]


def torchao_available() -> bool:
    return not isinstance(_cached_torchao(), str)


def offered_recipes() -> tuple[str, ...]:
    """The float8 recipe names the installed torchao offers."""
    f8 = load_torchao_float8()
    return tuple(r.value for r in f8.Float8LinearRecipeName)


def check_float8_runtime(
    recipe: str, emulate: bool, device: torch.device | str, capability: tuple[int, int] | None = None
) -> None:
    """Everything about the machine that can make ``float8.backend=torchao`` fail, as one-line errors: torchao
    missing, a recipe the installed version does not offer, no GPU or one older than sm_89 without emulation."""
    f8 = load_torchao_float8()
    offered = offered_recipes()
    if recipe not in offered:
        version = _cached_torchao()[0]
        raise Float8UnavailableError(
            f"float8.recipe={recipe} is not offered by the installed torchao {version} "
            f"(it has {', '.join(offered)}); choose one of those or install torchao==0.18.0"
        )
    del f8
    if emulate:
        return
    dev = torch.device(device)
    if dev.type != "cuda":
        raise Float8UnavailableError(
            f"float8.recipe={recipe} without emulation needs a CUDA GPU with compute "
            f"capability >= 8.9; set float8.emulate=true to run torchao's emulation on "
            f"{dev.type}"
        )
    if capability is None:
        capability = torch.cuda.get_device_capability(dev)
    if tuple(capability) < MIN_CAPABILITY:
        raise Float8UnavailableError(
            f"float8.recipe={recipe} needs compute capability >= 8.9 (Ada/Hopper or "
            f"newer), this GPU has {capability[0]}.{capability[1]}; set "
            f"float8.emulate=true (slow) or leave float8.recipe empty"
        )


def float8_linear_config(recipe: str, *, emulate: bool = False, enable_fsdp_float8_all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe`` with the two switches titanlike exposes."""
    f8 = load_torchao_float8()
    if recipe not in offered_recipes():
        raise Float8UnavailableError(f"float8.recipe={recipe} is not offered by the installed torchao")
    if enable_fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"float8.enable_fsdp_float8_all_gather needs float8.recipe=tensorwise, not {recipe}")
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)


def _shared_weights(model: nn.Module) -> set[int]:
    count: dict[int, int] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            count[id(w)] = count.get(id(w), 0) + 1
    return {k for k, n in count.items() if n > 1}


def float8_filter(model: nn.Module, filter_fqns: Iterable[str] = ("output",), modules: Iterable[str] | None = None):
    """``module_filter_fn(module, fqn) -> bool`` for torchao: an ``nn.Linear`` (not already float8) matching one of
    the ``modules`` patterns (None: any), whose FQN contains none of ``filter_fqns``, whose in/out features are
    multiples of 16, and whose weight is not shared."""
    filter_fqns = tuple(filter_fqns)
    patterns = None if modules is None else tuple(modules)
    shared = _shared_weights(model)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # torchao asks about containers too: descend
        return (
            not is_float8_linear(module)
            and (patterns is None or any(matches(p, fqn) for p in patterns))
            and not any(f in fqn for f in filter_fqns)
            and module.in_features % FLOAT8_ALIGN == 0
            and module.out_features % FLOAT8_ALIGN == 0
            and id(module.weight) not in shared
        )

    return keep


def is_float8_linear(module: nn.Module) -> bool:
    if not torchao_available():
        return False
    return isinstance(module, load_torchao_float8().float8_linear.Float8Linear)


@functools.cache
def _autocast_float8_linear_class():
    base = load_torchao_float8().float8_linear.Float8Linear

    class Float8Linear(base):  # same name: repr and type checks read as torchao's
        """torchao's ``Float8Linear`` that also honours CPU autocast (see the module docstring)."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            dev = input.device.type
            if dev != "cuda" and torch.is_autocast_enabled(dev):
                input = input.to(torch.get_autocast_dtype(dev))
            return super().forward(input)

    Float8Linear.__module__ = __name__
    Float8Linear.__qualname__ = "Float8Linear"
    return Float8Linear


def convert_to_float8(
    model: nn.Module,
    recipe: str,
    *,
    emulate: bool = False,
    filter_fqns: Iterable[str] = ("output",),
    enable_fsdp_float8_all_gather: bool = False,
    modules: Iterable[str] | None = None,
) -> list[str]:
    """Swap torchao ``Float8Linear`` into ``model`` in place; return the converted FQNs (sorted).

    Call on the unparallelized model (before TP/FSDP). ``modules``: module patterns the converted Linears must
    match (a registered model's float8-eligible entries, ``titanlike.sharding.float8_patterns``; None: every
    Linear). Raises :class:`Float8UnavailableError` (one line) if torchao is missing or lacks ``recipe``.
    """
    from torch.distributed.tensor import DTensor

    f8 = load_torchao_float8()
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "float8 conversion must come before tensor parallelism / FSDP (convert the plain model, "
            "then parallelize it)"
        )
    config = float8_linear_config(recipe, emulate=emulate, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(model, filter_fqns, modules))
    cls = _autocast_float8_linear_class()
    converted = []
    for name, m in model.named_modules():
        if is_float8_linear(m):
            m.__class__ = cls
            converted.append(name)
    converted.sort()
    model._float8_converted = tuple(converted)
    model._float8_recipe = recipe
    model._float8_fsdp_all_gather = enable_fsdp_float8_all_gather
    return converted


def float8_tensorwise_tp(model: nn.Module, patterns: Iterable[str]) -> bool:
    """True when every module matching ``patterns`` (a model's float8-eligible sharding entries) is a tensorwise
    ``Float8Linear``, and there is at least one: then the TP plan can use torchao's float8 styles (float8
    all-gathers). Rowwise recipes, or a module the shape filter left high precision, keep the plain styles
    (Float8Linear accepts DTensor inputs)."""
    if getattr(model, "_float8_recipe", "") != "tensorwise":
        return False
    patterns = tuple(patterns)
    selected = [m for name, m in model.named_modules() if any(matches(p, name) for p in patterns)]
    return bool(selected) and all(is_float8_linear(m) for m in selected)


def precompute_float8_scales(model: nn.Module) -> None:
    """After the optimizer step: every FSDP float8-all-gathered weight's scale in one all-reduce (torchao)."""
    if getattr(model, "_float8_fsdp_all_gather", False):
        load_torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


# ------------------------------------------------------------------------------------------------ routed experts
def float8_grouped_mm(a, b_t, offs):
    """torchao's float8 grouped GEMM (``torchao.prototype.moe_training``: dynamic rowwise scales, power-of-2,
    ``torch._scaled_grouped_mm``; CUDA with Triton, compute capability 9.0+) with ``torch._grouped_mm``'s calling
    convention, the routed experts' swap point (``GroupedExperts.grouped_mm``): ``a`` (rows, in) row-major, ``b_t``
    (experts, in, out) column-major per expert, ``offs`` int32 group ends, every group a multiple of 16 rows (the
    experts pad them: ``grouped_mm_align``); bf16 out."""
    load_torchao_float8()  # torchao importable (one line otherwise), its import logs quieted
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )


def experts_float8_unavailable(emulate: bool) -> str | None:
    """Why the routed experts cannot take torchao's float8 grouped GEMM here (None: they can): it has no emulation,
    and needs CUDA compute capability 9.0+ and Triton."""
    if emulate:
        return "torchao's float8 grouped GEMM has no emulation"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return "torchao's float8 grouped GEMM needs CUDA compute capability 9.0+"
    if importlib.util.find_spec("triton") is None:
        return "torchao's float8 grouped GEMM needs Triton"
    return None


def convert_experts_to_float8(model: nn.Module, grouped_mm=None) -> list[str]:
    """Route every ``GroupedExperts`` of ``model`` through a float8 grouped GEMM (``grouped_mm``, default
    :func:`float8_grouped_mm`), groups padded to 16 rows; return their FQNs (sorted). Refused in one line, every
    module named: an expert ``dim`` or ``hidden_dim`` not a multiple of 16 (the GEMM's operands), ``impl="loop"``
    (float8 needs the grouped path)."""
    from titanlike.models.moe import GroupedExperts

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    problems = [
        f"'{n}' has dim {m.w1.shape[2]} / hidden {m.w1.shape[1]}, not multiples of {FLOAT8_ALIGN}"
        for n, m in found
        if m.w1.shape[2] % FLOAT8_ALIGN or m.w1.shape[1] % FLOAT8_ALIGN
    ]
    problems += [f"'{n}' runs the per-expert loop (experts_impl 'loop'); use 'auto' or 'grouped'" for n, m in found
                 if m.impl == "loop"]  # fmt: skip
    if problems:
        raise ValueError("float8 routed experts: " + "; ".join(problems))
    for _, m in found:
        m.grouped_mm, m.grouped_mm_align = grouped_mm or float8_grouped_mm, FLOAT8_ALIGN
    return sorted(n for n, _ in found)
