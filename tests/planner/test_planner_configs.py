"""The cluster configs: each loads with load_config at its intended world size, and its plan is legal and fits."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from titanlike.config import load_config, model_args_from_config
from titanlike.data import build_tokenizer
from titanlike.planner import hardware_for, make_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD = {
    "gpt2_small": 8,
    "llama3_1b": 8,
    "llama3_8b": 64,
    "llama3_70b": 256,
    "llama3_405b": 16384,
    "qwen3_30b_a3b": 64,
    "deepseek_v3_671b": 1024,
    "gpt_oss_120b": 128,
    "qwen3_next_80b_a3b": 128,
}


@lru_cache
def _vocab(name: str) -> int:
    return build_tokenizer(name).vocab_size


@pytest.mark.parametrize("name", sorted(WORLD))
def test_config_loads_and_plans(name):
    world = WORLD[name]
    cfg = load_config(["--job.config_file", str(CONFIGS / f"{name}.toml")], world_size=world)
    assert cfg.training.dtype == "bfloat16" and cfg.model.tokenizer in ("cl100k", "gpt2")
    assert cfg.parallelism.gpus_per_node == 8
    args = model_args_from_config(cfg, _vocab(cfg.model.tokenizer))
    plan = make_plan(cfg, world, hardware_for("H100", gpus_per_node=8), args, run_dry=False)
    assert plan.legal and plan.fits and plan.warnings == [], plan.warnings
    assert not plan.layout.groups["tp"].spanning
    assert plan.layout.tokens_per_step >= 64 * 1024


def test_deepseek_v3_671b_splits_its_61_layers_with_the_ends_weighed():
    """61 layers + 1 (embedding) + 2 (head and the MTP depth) = 64 units in DualPipeV's 32 stages of 2; pp rank 0
    holds the first and the last stage (the V)."""
    cfg = load_config(["--job.config_file", str(CONFIGS / "deepseek_v3_671b.toml")], world_size=1024)
    args = model_args_from_config(cfg, _vocab(cfg.model.tokenizer))
    plan = make_plan(cfg, 1024, hardware_for("H100", gpus_per_node=8), args, run_dry=False)
    blocks = [sum(n.startswith("layers.") for n in stage) for stage in plan.layout.stages]
    assert blocks == [1] + [2] * 30 + [0] and plan.layout.stages[-1] == ("norm", "output", "mtp")
    assert plan.layout.stage_ids(0) == [0, 31]
