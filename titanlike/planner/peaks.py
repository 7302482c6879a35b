"""The dense peak FLOP/s of each GPU, per dtype: the one table behind a run's MFU (:mod:`titanlike.training.mfu`)
and a plan's price (:mod:`titanlike.planner.hardware`). Pure data, no torch.

Peaks are the vendors' dense (no 2:4 sparsity) tensor-core numbers. Sources: NVIDIA A100 datasheet (2021);
H100 datasheet (2023, SXM5 / PCIe / NVL columns); H200 datasheet (2024, SXM: the same tensor cores and
clocks as H100 SXM); HGX/DGX B200 datasheets (2024, per-GPU = system / 8). The datasheets quote sparse
numbers for Hopper and Blackwell; the dense value is half of it. A100 has no FP8.

A datasheet peak is not what a matmul reaches (docs/facts.md, "Smaller ones"). MFU against the datasheet is the
conventional number and is kept; ``metrics.peak_tflops`` overrides the table (e.g. with a measured matmul peak for
"fraction of achievable") or supplies a peak for a device the table doesn't know.
"""

from __future__ import annotations

__all__ = ["PEAK_TFLOPS", "peak_key", "peak_tflops_for_name"]

# (name substring, {dtype: dense TFLOP/s}); the first match wins, so the specific variants come first.
# "tf32" is the float32 training number (TF32 tensor-core matmuls); "fp8" includes MXFP8 on Blackwell.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("A100", {"bf16": 312.0, "tf32": 156.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1670.0, "tf32": 417.5}),
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0}),
    ("H100", {"bf16": 989.0, "fp8": 1979.0, "tf32": 494.5}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", {"bf16": 835.0, "fp8": 1670.0, "tf32": 417.5}),
    ("H200", {"bf16": 989.0, "fp8": 1979.0, "tf32": 494.5}),  # SXM
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1100.0}),
]

_DTYPE_KEYS = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "bf16",
    "float16": "bf16",
    "fp8": "fp8",
    "float8": "fp8",
    "mxfp8": "fp8",
    "tf32": "tf32",
    "fp32": "tf32",
    "float32": "tf32",
}


def peak_key(training_dtype: str, float8_recipe: str = "") -> str:
    """The peak column for a run: ``fp8`` when a float8 recipe is on, else the training dtype's column.

    (A float8 run still does some matmuls in bf16; comparing against the fp8 peak is the strict choice.)
    """
    return "fp8" if float8_recipe else _DTYPE_KEYS.get(training_dtype, training_dtype)


def peak_tflops_for_name(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of the device called ``device_name`` (``torch.cuda.get_device_name``), or None."""
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r} for the peak FLOP table; use one of {sorted(_DTYPE_KEYS)}")
    for pattern, peaks in PEAK_TFLOPS:
        if pattern in device_name:
            return peaks.get(key)
    return None
