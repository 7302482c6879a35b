"""The [float8] decisions: which backend a configuration uses (torchao or Transformer Engine), which recipes each
takes, and the rules a float8 configuration must satisfy (pure: whether torchao / TE / the GPU can run it is
checked by the trainer before any process group starts)."""

from __future__ import annotations

__all__ = ["FLOAT8_RECIPES", "TE_FLOAT8_RECIPES", "TORCHAO_FLOAT8_RECIPES", "float8_backend", "float8_violations"]

# The float8.recipe names, written once: the config's choices, these rules and the kernels read them from here.
TORCHAO_FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearConfig names
TE_FLOAT8_RECIPES = ("delayed", "current", "block", "mxfp8")  # Transformer Engine recipes (model.kernels=te)
FLOAT8_RECIPES = TORCHAO_FLOAT8_RECIPES + TE_FLOAT8_RECIPES


def float8_backend(cfg) -> str:
    """``float8.backend`` resolved: ``auto`` is ``te`` when ``model.kernels=te``, else ``torchao``."""
    b = cfg.float8.backend
    return ("te" if cfg.model.kernels == "te" else "torchao") if b == "auto" else b


def _torchao_options_set(f) -> list[str]:
    """The torchao-only [float8] options given a non-default value."""
    return [
        k
        for k, on in (
            ("float8.emulate", f.emulate),
            ("float8.filter_fqns", f.filter_fqns != ["output"]),
            ("float8.enable_fsdp_float8_all_gather", f.enable_fsdp_float8_all_gather),
            ("float8.precompute_float8_dynamic_scale_for_fsdp", f.precompute_float8_dynamic_scale_for_fsdp),
        )
        if on
    ]


def float8_violations(cfg) -> list[str]:
    """The [float8] rules (pure arithmetic; whether torchao / TE / the GPU can run it is checked by the trainer)."""
    f, out = cfg.float8, []
    if not f.recipe:
        unused = (["float8.backend"] if f.backend != "auto" else []) + _torchao_options_set(f)
        if unused:
            out.append(
                f"{', '.join(unused)} set but float8.recipe is empty (float8 off); set float8.recipe "
                f"(torchao: {', '.join(TORCHAO_FLOAT8_RECIPES)}) or drop {'them' if len(unused) > 1 else 'it'}"
            )
        return out
    backend = float8_backend(cfg)
    if cfg.training.dtype == "float64":
        out.append(
            f"float8.recipe={f.recipe} does not combine with training.dtype=float64 (float8 GEMMs round to "
            f"8 bits); use float32 or bfloat16, or leave float8.recipe empty"
        )
    if backend == "torchao":
        if f.recipe not in TORCHAO_FLOAT8_RECIPES:
            out.append(
                f"float8.recipe={f.recipe} is a Transformer Engine recipe; with float8.backend=torchao use "
                f"{', '.join(TORCHAO_FLOAT8_RECIPES)} (or set model.kernels=te for TE's)"
            )
        if cfg.model.kernels != "torch":
            out.append(
                f"float8.backend=torchao converts nn.Linear layers, but model.kernels={cfg.model.kernels} "
                f"replaced them; use float8.backend=te with model.kernels=te, or model.kernels=torch"
            )
        if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
            out.append(
                f"float8.enable_fsdp_float8_all_gather needs float8.recipe=tensorwise (torchao all-gathers "
                f"only tensorwise-scaled weights in float8), not {f.recipe}"
            )
        if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
            out.append(
                "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather=true"
            )
    else:
        if cfg.model.kernels != "te":
            out.append(
                "float8.backend=te needs Transformer Engine kernels: set model.kernels=te (on a CUDA "
                "machine with TE), or use float8.backend=torchao"
            )
        if f.recipe not in TE_FLOAT8_RECIPES:
            out.append(
                f"float8.recipe={f.recipe} is a torchao recipe; with float8.backend=te use "
                f"{', '.join(TE_FLOAT8_RECIPES)}"
            )
        te_only_off = _torchao_options_set(f)
        if te_only_off:
            out.append(
                f"{', '.join(te_only_off)} apply to float8.backend=torchao only; unset them with float8.backend=te"
            )
    return out
