from __future__ import annotations

import pytest
import torch

from titanlike.models.llama import FLAVORS
from titanlike.training.mfu import device_peak_flops, mfu, peak_key, peak_tflops_for_name


@pytest.mark.parametrize(
    "name,dtype,expected",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "bfloat16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp8", None),  # no FP8 on Ampere
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "fp8", 1670.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200", "float32", 494.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA B200", "mxfp8", 4500.0),
        ("NVIDIA GeForce RTX 3090", "bf16", None),
    ],
)
def test_peak_table(name, dtype, expected):
    assert peak_tflops_for_name(name, dtype) == expected


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="dtype"):
        peak_tflops_for_name("NVIDIA H100", "int4")


def test_device_peak_cpu_is_none_and_override_wins():
    assert device_peak_flops("cpu") is None
    assert device_peak_flops(torch.device("cpu"), "fp8") is None
    assert device_peak_flops("cpu", override_tflops=790.0) == pytest.approx(790e12)


def test_peak_key():
    assert peak_key("bfloat16") == "bf16"
    assert peak_key("float32") == "tf32"
    assert peak_key("bfloat16", "current") == "fp8"


def test_mfu_arithmetic():
    args = FLAVORS["8B"]
    fpt = args.flops_per_token(8192)
    # Llama-3 8B at 8k: 6 * 7.5e9 matmul params (blocks + head) + 12 * 32 * 4096 * 8192 for attention.
    assert 5.75e10 < fpt < 5.8e10
    # 1000 tokens/s per device on 8 devices at a 989 TFLOP/s peak.
    value = mfu(8000.0, fpt, 989e12, n_devices=8)
    assert value == pytest.approx(1000.0 * fpt / 989e12)
    assert mfu(8000.0, fpt, None) is None
    assert mfu(8000.0, fpt, 0.0) is None
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 1.0, n_devices=0)
