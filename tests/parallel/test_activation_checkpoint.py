"""Activation checkpointing: identical gradients to no AC (float64), unchanged names, real recomputation."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlike.config import ActivationCheckpoint
from titanlike.models.llama import FLAVORS, Transformer, TransformerBlock
from titanlike.parallel.activation_checkpoint import apply_ac, is_checkpointed

CASES = [("full", "op"), ("selective", "1"), ("selective", "2"), ("selective", 3), ("selective", "op")]


def _model(n_layers=4) -> Transformer:
    torch.manual_seed(0)
    args = FLAVORS["tiny"].replace(vocab_size=64, n_layers=n_layers)
    model = Transformer(args).to(torch.float64)
    model.init_weights()
    return model


def _grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,option", CASES)
def test_ac_gradients_match_no_ac_and_names_unchanged(mode, option):
    ref = _model()
    model = copy.deepcopy(ref)
    layers_before = dict(model.layers.items())
    names_before = [n for n, _ in model.named_parameters()]
    sd_before = list(model.state_dict().keys())
    apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option))

    assert [n for n, _ in model.named_parameters()] == names_before
    assert list(model.state_dict().keys()) == sd_before
    assert all(model.layers[k] is v for k, v in layers_before.items())
    assert all(isinstance(b, TransformerBlock) for b in model.layers.values())
    n = {"1": 1, "2": 2, 3: 3}.get(option)
    expected = [True] * 4 if n is None or mode == "full" else [i % n == 0 for i in range(4)]
    assert [is_checkpointed(b) for b in model.layers.values()] == expected

    tokens = torch.randint(0, 64, (2, 17))
    ref_loss, ref_grads = _grads(ref, tokens)
    loss, grads = _grads(model, tokens)
    assert torch.equal(loss, ref_loss) or (loss - ref_loss).abs() <= 1e-12
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max() <= 1e-12, name
    # A second step through the same checkpointed model still matches (no state left behind).
    loss2, grads2 = _grads(model, tokens)
    assert all((grads2[k] - g).abs().max() <= 1e-12 for k, g in ref_grads.items())


def _backward_op_counts(model, tokens) -> Counter:
    logits = model(tokens[:, :-1])
    loss = logits.float().logsumexp(-1).sum()
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_recomputation_happens_as_configured():
    """Full AC reruns the matmuls in the backward; op-level AC reruns element-wise ops but no matmul."""
    tokens = torch.randint(0, 64, (2, 9))
    base = _model(n_layers=2)
    counts = {"none": _backward_op_counts(base, tokens)}
    for label, cfg in (
        ("full", ActivationCheckpoint(mode="full")),
        ("op", ActivationCheckpoint(mode="selective", selective_ac_option="op")),
    ):
        counts[label] = _backward_op_counts(apply_ac(copy.deepcopy(base), cfg), tokens)
    mm = {k: c["mm"] for k, c in counts.items()}
    silu = {k: c["silu"] for k, c in counts.items()}
    sdpa = {
        k: sum(v for op, v in c.items() if op.startswith("_scaled_dot_product") and "backward" not in op)
        for k, c in counts.items()
    }
    # Full AC recomputes 6 of the 7 linears per block: non-reentrant checkpointing stops the recomputation
    # once every saved tensor is regenerated, and w2's output is not saved (only added to the residual).
    assert mm["full"] == mm["none"] + 12
    assert mm["op"] == mm["none"]
    assert silu["none"] == 0 and silu["full"] == 2 and silu["op"] == 2
    assert sdpa["none"] == 0 and sdpa["op"] == 0 and sdpa["full"] == 2


def test_no_ac_is_a_no_op_and_bad_options_are_one_line_errors():
    model = _model(n_layers=2)
    assert apply_ac(model, ActivationCheckpoint(mode="none")) is model
    assert not any(is_checkpointed(b) for b in model.layers.values())
    for bad in ("0", "-1", "ops", 1.5):
        with pytest.raises(ValueError, match="selective_ac_option"):
            apply_ac(_model(n_layers=2), ActivationCheckpoint(mode="selective", selective_ac_option=bad))
    with pytest.raises(ValueError, match="mode"):
        apply_ac(model, ActivationCheckpoint(mode="partial"))
    apply_ac(model, ActivationCheckpoint(mode="full"))
    with pytest.raises(ValueError, match="already"):
        apply_ac(model, ActivationCheckpoint(mode="full"))


def test_pipeline_stage_uses_global_layer_indices():
    """A stage holding layers 1..3 checkpoints the same blocks as the full model does (every 2nd: 0, 2)."""
    from titanlike.parallel.pipeline import build_stage

    args = FLAVORS["tiny"].replace(vocab_size=64, n_layers=4)
    stage = build_stage(Transformer(args), ["layers.1", "layers.2", "layers.3"])
    apply_ac(stage, ActivationCheckpoint(mode="selective", selective_ac_option="2"))
    assert {k: is_checkpointed(b) for k, b in stage.layers.items()} == {"1": False, "2": True, "3": False}
    h = torch.randn(2, 5, 32, requires_grad=True)
    stage(h).sum().backward()
    assert h.grad is not None and all(p.grad is not None for p in stage.parameters())


def test_eval_forward_skips_checkpointing_and_matches():
    ref = _model(n_layers=2)
    model = apply_ac(copy.deepcopy(ref), ActivationCheckpoint(mode="full"))
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


def test_ac_under_tensor_parallelism_and_fsdp_two_ranks(request, tmp_path_factory):
    """tp=2 (plain and sequence-parallel) and FSDP dp=2, float64: every AC mode gives the one-device gradients;
    under TP, op-level AC issues no collective in the backward beyond what no-AC does (their outputs are
    saved), full AC does. (ac_parallel_worker.py, in the session's 2-rank launch: tests/parallel/shared_launch.py)"""
    import shared_launch

    out = shared_launch.results("ac", 2, request, tmp_path_factory)
    assert out["worst"] <= 1e-12, out
    res = out["results"]
    for layout in ("tp", "sp", "fsdp"):
        assert all(res[f"{layout}/{m}"]["same_names"] for m in ("none", "full", "every2", "op"))
    for layout in ("tp", "sp"):
        none, full, op = (res[f"{layout}/{m}"]["backward_collectives"] for m in ("none", "full", "op"))
        assert op == none < full, res
