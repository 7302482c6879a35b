"""Per-block torch.compile (with selective op-level AC, the hardest path) matches eager; names unchanged.

One compilation of one tiny shape (~15 s on CPU): both blocks share the compiled graph.
"""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from titanlike.config import ActivationCheckpoint, Compile
from titanlike.models.llama import FLAVORS, Transformer
from titanlike.parallel.activation_checkpoint import apply_ac
from titanlike.parallel.compile import _fullgraph, apply_compile


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_blocks_match_eager_and_keep_names():
    torch.manual_seed(0)
    ref = Transformer(FLAVORS["tiny"].replace(vocab_size=64))
    ref.init_weights()
    model = copy.deepcopy(ref)
    assert apply_compile(model, Compile(enable=False)) is model
    assert all(b._compiled_call_impl is None for b in model.layers.values())

    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    blocks_before = dict(model.layers.items())
    apply_compile(model, Compile(enable=True, backend="inductor"))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert all(model.layers[k] is b and b._compiled_call_impl is not None for k, b in blocks_before.items())

    counters.clear()
    tokens = torch.randint(0, 64, (2, 17))
    ref_loss, ref_grads = _loss_and_grads(ref, tokens)
    for _ in range(2):  # the second step runs the cached graph
        loss, grads = _loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph serves both blocks
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_fullgraph_except_around_transformer_engine_modules():
    block = Transformer(FLAVORS["tiny"].replace(vocab_size=64)).layers["0"]
    assert _fullgraph(block)
    te_like = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    block.attention.wq = te_like(32, 32, bias=False)
    assert not _fullgraph(block)


def test_compiled_moe_blocks_break_the_graph_at_routing_and_match_eager():
    """Qwen3-MoE (tiny: block 0 dense, block 1 MoE with the aux loss): the MoE block is compiled with graph breaks
    (bincount's data-dependent shape, the host-side counts), the dense one in one graph; forward and every gradient
    equal eager's in float64 (backend "eager": dynamo's capture and its breaks; the dense test above runs inductor)."""
    from titanlike.config import load_config, model_args_from_config
    from titanlike.models import get_spec
    from titanlike.models.moe import set_aux_loss_denominator

    cfg = load_config(["--model.name", "qwen3_moe", "--model.flavor", "tiny", "--model.dim", "64"], world_size=1)
    ref = get_spec("qwen3_moe").build(model_args_from_config(cfg, vocab_size=64)).double()
    ref.init_weights(seed=0)
    model = copy.deepcopy(ref)
    assert [_fullgraph(b) for b in model.layers.values()] == [True, False]
    counters.clear()
    apply_compile(model, Compile(enable=True, backend="eager"))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    for m in (ref, model):
        set_aux_loss_denominator(m, 4)
    (ref_loss, ref_grads), (loss, grads) = _loss_and_grads(ref, tokens), _loss_and_grads(model, tokens)
    assert counters["graph_break"] and counters["stats"]["unique_graphs"] > 1  # compiled, around the routing
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    assert all(torch.allclose(grads[n], ref_grads[n], rtol=0, atol=1e-12) for n in grads)
