"""Qwen3-MoE: Qwen3's attention (imported, not copied), MoE blocks, the published sizes counted total and active."""

from __future__ import annotations

import pytest
import torch

from titanlike.models import get_spec
from titanlike.models.moe import MoE, set_aux_loss_denominator
from titanlike.models.qwen3 import Attention
from titanlike.models.qwen3_moe import FLAVORS, Qwen3MoeArgs

SPEC = get_spec("qwen3_moe")


@pytest.mark.parametrize(
    "flavor,total,active",
    [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)],  # Qwen's model cards: 30.5B / 3.3B, 235B / 22B
)
def test_published_sizes_total_and_active(flavor, total, active):
    args = FLAVORS[flavor]
    assert (args.num_experts, args.top_k, args.route_norm, args.num_shared_experts) == (128, 8, True, 0)
    assert abs(args.num_params() / total - 1) < 0.01
    assert abs(args.num_active_params() / active - 1) < 0.03
    assert sum(p.numel() for p in SPEC.build_meta(args).parameters()) == args.num_params()


def test_deepseek_shaped_flavor_has_its_routing_and_dense_first_layers():
    args = FLAVORS["deepseek"]
    m = args.moe_args()
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.score_func, m.num_groups, m.topk_groups) == (
        256,
        8,
        1,
        "sigmoid",
        8,
        4,
    )
    model = SPEC.build_meta(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert [hasattr(model.layers[str(i)], "feed_forward") for i in range(4)] == [True, True, True, False]
    assert SPEC.num_experts(args) == 256


def test_tiny_model_trains_with_qwen3_attention_and_moe_blocks():
    args = FLAVORS["tiny"].replace(vocab_size=64)
    model = SPEC.build(args).to(torch.float64)
    model.init_weights(seed=0)
    assert all(isinstance(b.attention, Attention) for b in model.layers.values())
    assert not hasattr(model.layers["0"], "moe") and isinstance(model.layers["1"].moe, MoE)  # n_dense_layers 1
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert "layers.1.moe.expert_bias" in model.state_dict()  # persistent: checkpointed
    set_aux_loss_denominator(model, 2)
    logits = model(torch.randint(0, 64, (2, 8)))
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert model.layers["1"].moe.expert_load.sum() == 2 * 8 * args.top_k


def test_flops_per_token_counts_active_parameters():
    a = FLAVORS["30B-A3B"]
    dense_equivalent = Qwen3MoeArgs(**{**a.__dict__, "top_k": a.num_experts})  # every expert active
    assert a.flops_per_token(4096) < dense_equivalent.flops_per_token(4096) / 5  # 3.3B of 30.5B, + attention
    attention = 12 * a.n_layers * a.n_heads * a.head_dim * 4096
    matmul = a.num_active_params(include_embedding=False) - a.n_layers * (2 * a.head_dim + 2 * a.dim) - a.dim
    assert a.flops_per_token(4096) == 6 * matmul + attention
