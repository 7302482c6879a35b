"""RoPE scaling against transformers' own ``ROPE_INIT_FUNCTIONS`` (the outside reference): YaRN as DeepSeek-V3,
gpt-oss (``truncate: false``) and Qwen3 long-context configs set it, llama3 scaling, and the tables' attention
factor. transformers computes the frequencies in float32; ours are float64, so compare at float32 tolerance."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from titanlike.models.layers import rope_attention_factor, rope_inv_freq, rope_tables, yarn_mscale


def _yarn_args(p: dict, max_pos: int) -> SimpleNamespace:
    return SimpleNamespace(
        rope_scaling="yarn",
        rope_scaling_factor=p.get("factor") or max_pos / p["original_max_position_embeddings"],
        rope_original_max_seq_len=p["original_max_position_embeddings"],
        rope_beta_fast=p.get("beta_fast") or 32.0,
        rope_beta_slow=p.get("beta_slow") or 1.0,
        rope_mscale=p.get("mscale") or 0.0,
        rope_mscale_all_dim=p.get("mscale_all_dim") or 0.0,
        rope_attention_factor=p.get("attention_factor") or 0.0,
        rope_truncate=p.get("truncate", True),
    )


YARN = {
    # DeepSeek-V3's published rope_scaling (mscale == mscale_all_dim: attention factor 1), rotary dim 64
    "deepseek_v3": lambda: DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
    ),
    # mscale != mscale_all_dim: a non-trivial attention factor
    "deepseek_mscale": lambda: DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=32768,
    ),
    "gpt_oss": lambda: GptOssConfig(),  # factor 32, truncate false, theta 150000, head_dim 64
    "qwen3_yarn": lambda: Qwen3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        max_position_embeddings=131072,
    ),
}


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_matches_transformers(name):
    cfg = YARN[name]()
    p = cfg.rope_parameters
    dim = getattr(cfg, "qk_rope_head_dim", None) or cfg.head_dim
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    args = _yarn_args(p, cfg.max_position_embeddings)
    ours = rope_inv_freq(dim, p["rope_theta"], args)
    assert ours.dtype == torch.float64 and ours.shape == ref_freq.shape
    torch.testing.assert_close(ours.float(), ref_freq, rtol=2e-6, atol=0)
    assert rope_attention_factor(args) == pytest.approx(ref_factor, rel=1e-12)
    cos, sin = rope_tables(dim, 64, p["rope_theta"], args)
    angles = torch.outer(torch.arange(64, dtype=torch.float64), ours)
    torch.testing.assert_close(cos, angles.cos() * ref_factor, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, angles.sin() * ref_factor, rtol=1e-12, atol=1e-12)


def test_yarn_acts():
    """YaRN keeps the fast frequencies, divides the slow ones by the factor, and truncation moves the ramp."""
    cfg = YARN["gpt_oss"]()
    p = cfg.rope_parameters
    args = _yarn_args(p, cfg.max_position_embeddings)
    plain = rope_inv_freq(cfg.head_dim, p["rope_theta"])
    ours = rope_inv_freq(cfg.head_dim, p["rope_theta"], args)
    assert ours[0] == plain[0]
    assert ours[-1] == pytest.approx(plain[-1] / p["factor"], rel=1e-12)
    truncated = rope_inv_freq(cfg.head_dim, p["rope_theta"], SimpleNamespace(**{**vars(args), "rope_truncate": True}))
    assert not torch.equal(truncated, ours)
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40) + 1)


def test_llama3_matches_transformers():
    cfg = LlamaConfig(
        head_dim=64,
        hidden_size=512,
        num_attention_heads=8,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    ref, factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    args = SimpleNamespace(
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
    )
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, args).float(), ref, rtol=2e-6, atol=0)
    assert factor == 1.0 and rope_attention_factor(args) == 1.0


def test_unknown_scaling_refused():
    with pytest.raises(ValueError, match="not one of none, llama3, yarn"):
        rope_inv_freq(64, 1e4, SimpleNamespace(rope_scaling="longrope"))
