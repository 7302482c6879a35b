"""Per-block torch.compile (with selective op-level AC, the hardest path) matches eager; names unchanged.

One compilation of one tiny shape per family (~15 s each on CPU for inductor): blocks of the same kind share a graph.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

from titanlike.config import ActivationCheckpoint, Compile
from titanlike.models.llama import FLAVORS, Transformer
from titanlike.parallel.activation_checkpoint import apply_ac
from titanlike.parallel.compile import _fullgraph, apply_compile, compiled_blocks


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
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph for both blocks, no recompile
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_blocks_under_full_checkpointing_match_eager():
    """Full AC (every block checkpointed, no context function) inside compiled blocks: captured whole (dynamo
    refuses checkpoint's default ``context_fn`` passed explicitly, so full AC passes none), equal to eager in
    float64."""
    torch.manual_seed(0)
    ref = Transformer(FLAVORS["tiny"].replace(vocab_size=64)).double()
    ref.init_weights()
    model = copy.deepcopy(ref)
    apply_ac(model, ActivationCheckpoint(mode="full"))
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    counters.clear()
    tokens = torch.randint(0, 64, (2, 17))
    ref_loss, ref_grads = _loss_and_grads(ref, tokens)
    for _ in range(2):
        loss, grads = _loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-12, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_fullgraph_except_around_transformer_engine_modules():
    block = Transformer(FLAVORS["tiny"].replace(vocab_size=64)).layers["0"]
    assert _fullgraph(block)
    te_like = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    block.attention.wq = te_like(32, 32, bias=False)
    assert not _fullgraph(block)


# every family but llama (the test above), tiny, float64, one compilation each, and its backend: inductor where CI
# can afford it (an MoE block takes ~60 s of CPU inductor), aot_eager (dynamo's capture and AOT autograd's graphs, no
# code generation) for the other MoE families: breaks and recompiles are dynamo's decision, and both backends gave
# the same counts for every family (docs/performance.md has each family's inductor numbers)
FAMILIES = {
    "gpt2": "inductor",
    "qwen3": "inductor",
    "qwen3_moe": "inductor",
    "gpt_oss": "aot_eager",
    "deepseek_v3": "aot_eager",
    "qwen3_next": "aot_eager",
}


def _family_step(model, tokens):
    """Forward (every output: DeepSeek-V3's MTP depths too), a cross entropy on each, backward; loss and gradients."""
    model.zero_grad(set_to_none=True)
    outs = model(tokens[:, :-1])
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum(torch.nn.functional.cross_entropy(o.flatten(0, 1), tokens[:, 1:].flatten()) for o in outs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _process_settings() -> tuple:
    """The process-wide dynamo settings an MoE block is traced under (titanlike.parallel.compile._dynamo_settings)."""
    config = torch._dynamo.config
    return config.capture_scalar_outputs, getattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint", None)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_compiles_whole_and_matches_eager(family):
    """Each family's blocks (DeepSeek-V3's MTP depth included) compiled with ``fullgraph=True``: no graph
    break (fullgraph would raise), no compilation after the second step although the MoE routing differs every step
    (the rows per expert are unbacked sizes, not guarded values), and the loss, every gradient and the MoE load
    counters equal eager in float64 (inductor may reorder a reduction: 1e-12)."""
    from titanlike.config import load_config, model_args_from_config
    from titanlike.models import get_spec
    from titanlike.models.moe import moe_modules, set_aux_loss_denominator

    cfg = load_config(["--model.name", family, "--model.flavor", "tiny", "--model.dim", "64"], world_size=1)
    ref = get_spec(family).build(model_args_from_config(cfg, vocab_size=64)).double()
    ref.init_weights(seed=0)
    model = copy.deepcopy(ref)
    blocks = compiled_blocks(model)
    assert all(_fullgraph(b) for b in blocks)
    assert len(blocks) == len(model.layers) + (family == "deepseek_v3")  # the MTP depth's block
    for m in (ref, model):
        set_aux_loss_denominator(m, 4)
    torch._dynamo.reset()
    counters.clear()
    backend = os.environ.get("TITANLIKE_COMPILE_BACKEND", FAMILIES[family])  # inductor for all: the docs' table
    before = _process_settings()
    apply_compile(model, Compile(enable=True, backend=backend))
    assert _process_settings() == before  # the MoE blocks' dynamo settings patched around their calls only
    graphs = []
    for step in range(3):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        (ref_loss, ref_grads), (loss, grads) = _family_step(ref, tokens), _family_step(model, tokens)
        assert grads.keys() == ref_grads.keys() == {n for n, _ in model.named_parameters()}
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-12, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] >= 1 and graphs[2] == graphs[1], graphs  # nothing compiled after the second step
    assert _process_settings() == before
    for a, b in zip(moe_modules(ref), moe_modules(model)):
        assert torch.equal(a.expert_load, b.expert_load) and torch.equal(a.last_load, b.last_load)
        assert (a.aux_loss_sum is None) == (b.aux_loss_sum is None)
        assert a.aux_loss_sum is None or torch.allclose(a.aux_loss_sum, b.aux_loss_sum, rtol=0, atol=1e-12)
