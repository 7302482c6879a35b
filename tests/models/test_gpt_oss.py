"""gpt-oss as a titanlike model: its flavors' sizes (the published 20b / 120b counts), the layer types and windows, the
attention FLOPs counting only a window's keys, the config keys that turn the window and the sinks off (each changes
the loss), the clamped experts, and the refusals. (Against transformers: tests/checkpoint/test_hf_gpt_oss.py; under
every layout: the gates.)"""

from __future__ import annotations

import pytest
import torch

from titanlike.config import load_config, model_args_from_config
from titanlike.errors import ConfigError
from titanlike.loss import cross_entropy_loss
from titanlike.models import get_spec
from titanlike.models.moe import clamped_swiglu

SPEC = get_spec("gpt_oss")


def _args(*argv):
    cfg = load_config(["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.seq_len", "16", *argv])
    return model_args_from_config(cfg, vocab_size=64)


def _loss(args) -> float:
    model = SPEC.build(args).to(torch.float64)
    model.init_weights(seed=0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return cross_entropy_loss(model(x), x.roll(-1, 1), reduction="sum").item()


def test_published_sizes_and_layer_types():
    big, small = SPEC.flavors["120b"], SPEC.flavors["20b"]
    assert round(small.num_params() / 1e9, 1) == 20.9 and round(big.num_params() / 1e9, 1) == 116.8
    assert round(small.num_active_params(include_embedding=False) / 1e9, 2) == 3.61  # OpenAI's "3.6B active"
    assert round(big.num_active_params(include_embedding=False) / 1e9, 2) == 5.13  # "5.1B active"
    model = SPEC.build_meta(small.replace(vocab_size=201088, n_layers=2))
    assert sum(p.numel() for p in model.parameters()) == small.replace(vocab_size=201088, n_layers=2).num_params()
    assert [small.window_of(i) for i in range(4)] == [128, None, 128, None]  # sliding first, as transformers'
    assert [model.layers[str(i)].attention.sdpa.window for i in range(2)] == [128, None]
    assert SPEC.flavors["debugmodel"].sliding_window < load_config(["--model.name", "gpt_oss"]).training.seq_len


def test_attention_flops_count_only_the_window():
    a = SPEC.flavors["20b"]
    q = a.n_heads * a.head_dim
    full = a.replace(sliding_window=10**9)
    s = 8192  # 12 q per key per layer: the sliding half of the layers counts 128 keys instead of 8192
    assert full.flops_per_token(s) - a.flops_per_token(s) == 12 * q * (a.n_layers // 2) * (s - 128)
    assert a.flops_per_token(64) == full.flops_per_token(64)  # a window wider than the sequence keeps everything


def test_window_and_sinks_keys_change_the_loss():
    base = _loss(_args())
    assert _args("--model.sliding_window", "1000").sliding_window == 1000
    assert abs(_loss(_args("--model.sliding_window", "1000")) - base) > 1e-6
    assert abs(_loss(_args("--model.attention_sinks", "false")) - base) > 1e-6
    assert abs(_loss(_args("--model.sliding_window", "16")) - _loss(_args("--model.sliding_window", "1000"))) < 1e-12


def test_clamped_swiglu_is_transformers_activation():
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gate_up = torch.randn(5, 12, dtype=torch.float64) * 10
    theirs = GptOssExperts._apply_gate(SimpleNamespace(limit=7.0, alpha=1.702), gate_up)
    assert torch.equal(clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2]), theirs)


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="model.sliding_window"):
        load_config(["--model.name", "gpt_oss", "--model.sliding_window", "-1"])
    assert any("layer_types" in p for p in SPEC.shape_violations(SPEC.flavors["tiny"].replace(layer_types=("x",))))
    assert any("top_k" in p for p in SPEC.shape_violations(SPEC.flavors["tiny"].replace(top_k=9)))
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):  # 4 heads, 2 kv heads: tp 4 cannot split
        load_config(
            ["--model.name", "gpt_oss", "--model.flavor", "tiny", "--parallelism.tensor_parallel_degree", "4"],
            world_size=4,
        )


def test_compiled_blocks_with_selective_ac_match_eager():
    """Per-block torch.compile with selective op AC on gpt-oss (a sliding and a full layer, sinks, the forward's causal
    mask built outside the blocks): no graph break from attention, equal to eager in float64 (backend aot_eager:
    dynamo's capture and AOT autograd, without inductor's code generation)."""
    import copy

    from torch._dynamo.utils import counters

    from titanlike.config import ActivationCheckpoint, Compile
    from titanlike.parallel.activation_checkpoint import apply_ac
    from titanlike.parallel.compile import apply_compile

    ref = SPEC.build(_args().replace(load_balance_coeff=None)).to(torch.float64)
    ref.init_weights(seed=0)
    model = copy.deepcopy(ref)
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(m(x), x.roll(-1, 1), reduction="sum")
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    counters.clear()
    ref_loss, ref_grads = loss_and_grads(ref)
    loss, grads = loss_and_grads(model)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) <= 1e-12
    # no break: none from the window, the sinks or the mask, nor from the MoE routing (compiled with fullgraph)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_start_up_line_names_the_windows_and_sinks():
    from titanlike.training.trainer import attention_note

    cfg = load_config(["--model.name", "gpt_oss", "--model.flavor", "tiny"])
    model = SPEC.build_meta(_args())
    note = attention_note(cfg, torch.device("cpu"), 0, [model])
    assert note == (
        "causal mask (SDPA with an exact boolean mask); sliding window 4 in 1 of 2 layers; a learned sink per head "
        "(explicit softmax)"
    )
    assert attention_note(cfg, torch.device("cpu"), 0, []) == "causal mask (SDPA's causal kernel)"
