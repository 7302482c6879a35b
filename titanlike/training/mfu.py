"""Model FLOP utilisation (MFU): achieved model FLOP/s over the hardware's dense peak.

The FLOP convention is the one of :meth:`titanlike.models.llama.ModelArgs.flops_per_token` (PaLM appendix B,
as in torchtitan): ``6 * matmul parameters + 12 * n_layers * dim * seq_len`` per trained token, i.e. forward
2 FLOPs per multiply-add, backward twice the forward, attention counted for the full (not causal-halved)
score matrix, the embedding lookup not counted, the output head counted. Recomputation by activation
checkpointing is *not* counted (it is overhead, and MFU is meant to show it), nor are the optimizer's FLOPs.

    mfu = tokens_per_s * flops_per_token / (peak_flops_per_device * n_devices)

where ``tokens_per_s`` is the throughput of all ``n_devices`` together (every device of the job, whatever
the mix of data, tensor and pipeline parallelism). ``mfu`` returns a fraction (0.42, not 42).

Peaks are the vendors' dense (no 2:4 sparsity) tensor-core numbers. Sources: NVIDIA A100 datasheet (2021);
H100 datasheet (2023, SXM5 / PCIe / NVL columns); H200 datasheet (2024, SXM: the same tensor cores and
clocks as H100 SXM); HGX/DGX B200 datasheets (2024, per-GPU = system / 8). The datasheets quote sparse
numbers for Hopper and Blackwell; the dense value is half of it. A100 has no FP8.

A datasheet peak is not what a matmul reaches (docs/facts.md, "Smaller ones"). MFU against the datasheet is the
conventional number and is kept; ``metrics.peak_tflops`` overrides the table (e.g. with a measured matmul peak for
"fraction of achievable") or supplies a peak for a device the table doesn't know.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "peak_key", "peak_tflops_for_name", "device_peak_flops", "mfu"]

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
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16",
    "fp8": "fp8", "float8": "fp8", "mxfp8": "fp8",
    "tf32": "tf32", "fp32": "tf32", "float32": "tf32",
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


def device_peak_flops(device: torch.device | str, dtype: str = "bf16", override_tflops: float = 0.0) -> float | None:
    """Dense peak FLOP/s of one ``device`` for ``dtype``; None on CPU or for a device/dtype the table lacks.

    ``override_tflops > 0`` (``metrics.peak_tflops``) is returned instead of the table, on any device.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tflops = peak_tflops_for_name(torch.cuda.get_device_name(device), dtype)
    return None if tflops is None else tflops * 1e12


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None, n_devices: int = 1) -> float | None:
    """Model FLOP utilisation as a fraction, or None when the peak is unknown.

    ``tokens_per_s``: throughput of all ``n_devices`` together; ``flops_per_token``: from
    ``ModelArgs.flops_per_token(seq_len)``; ``peak_flops``: of one device (:func:`device_peak_flops`).
    """
    if peak_flops is None or peak_flops <= 0:
        return None
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    return tokens_per_s * flops_per_token / (peak_flops * n_devices)
