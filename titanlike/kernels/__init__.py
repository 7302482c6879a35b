"""Swappable kernel backends: ``model.kernels = torch`` (the plain model) or ``te`` (Transformer Engine)."""

from titanlike.kernels.te import (
    FP8_RECIPES,
    TEUnavailableError,
    convert_kernels,
    convert_to_te,
    load_te,
    make_fp8_recipe,
    te_available,
    te_to_torch_state_dict,
    torch_to_te_state_dict,
)

__all__ = [
    "FP8_RECIPES",
    "TEUnavailableError",
    "convert_kernels",
    "convert_to_te",
    "load_te",
    "make_fp8_recipe",
    "te_available",
    "te_to_torch_state_dict",
    "torch_to_te_state_dict",
]
