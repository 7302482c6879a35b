"""Model FLOP utilisation (MFU): achieved model FLOP/s over the hardware's dense peak.

The FLOP convention is the one of :meth:`titanlike.models.llama.ModelArgs.flops_per_token` (PaLM appendix B,
as in torchtitan): ``6 * matmul parameters + 12 * n_layers * dim * seq_len`` per trained token, i.e. forward
2 FLOPs per multiply-add, backward twice the forward, attention counted for the full (not causal-halved)
score matrix, the embedding lookup not counted, the output head counted. Recomputation by activation
checkpointing is *not* counted (it is overhead, and MFU is meant to show it), nor are the optimizer's FLOPs.

    mfu = tokens_per_s * flops_per_token / (peak_flops_per_device * n_devices)

where ``tokens_per_s`` is the throughput of all ``n_devices`` together (every device of the job, whatever
the mix of data, tensor and pipeline parallelism). ``mfu`` returns a fraction (0.42, not 42).

Peaks are the vendors' dense (no 2:4 sparsity) tensor-core numbers, from one table shared with the planner
(:mod:`titanlike.planner.peaks`, which names the datasheets). A datasheet peak is not what a matmul reaches
(docs/facts.md, "Smaller ones"); ``metrics.peak_tflops`` overrides the table or supplies a peak it lacks.
"""

from __future__ import annotations

import torch

from titanlike.planner.peaks import PEAK_TFLOPS, peak_key, peak_tflops_for_name

__all__ = ["PEAK_TFLOPS", "peak_key", "peak_tflops_for_name", "device_peak_flops", "mfu"]


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
