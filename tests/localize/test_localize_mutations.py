"""The divergence localiser on every planted mutation of the equality gates (tests/parallel/gate.py MUTATIONS,
pipeline_gate.py's): each localised to the module and phase where it acts (step 1 unless the bug acts later: the
expert-bias update shows in step 2's routing, the validation forward's leftovers in step 2), and clean layouts of
tp / sp / fsdp / hsdp / cp / ep / pp reported clean. One launch per world size (tests/localize/localize_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch.distributed.pipelining import PipelineStage

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from dist_utils import run_script  # noqa: E402

INFERENCE_RESTORES_BUFFERS = hasattr(PipelineStage, "_pre_metadata_inference_backup")
# case -> (module, phase, step) of the first divergence, None: no divergence
EXPECTED = {
    "tp2_sp": None,
    "fsdp2": None,
    "cp2": None,
    "tp2_ac_full": None,  # the recomputation in backward is no point of its own
    "cp2_ac_selective_op": None,
    "gpt2 tp2_sp_accum2": None,
    "MUT tp2 no f backward all-reduce": ("layers.1.feed_forward", "backward", 1),
    "MUT tp2_sp no f backward reduce-scatter": ("layers.1.feed_forward", "backward", 1),
    "MUT tp2 CE without max all-reduce": ("output", "backward", 1),
    "MUT tp2_sp norms not sequence-parallel": ("layers.0.attention_norm", "gradient", 1),
    "MUT fsdp2 loss averaged per rank": ("output", "backward", 1),
    "MUT fsdp2 gradients averaged": ("tok_embeddings", "gradient", 1),
    "MUT gpt2 tp2 c_attn plain ColwiseParallel": ("layers.0.attn.core", "forward", 1),
    "MUT tp2_sp to_empty drops the gradient hooks": ("tok_embeddings", "gradient", 1),
    "MUT fsdp2 init ignores the shards": ("tok_embeddings", "forward", 1),
    "MUT gpt2 tp2 init of fused c_attn as a plain shard": ("layers.0.attn.c_attn", "forward", 1),
    "MUT cp2 K/V grads not reduce-scattered": ("layers.1.attention.sdpa", "backward", 1),
    "MUT cp2 chunks in wrong order": ("layers.0.attention.sdpa", "forward", 1),
    "MUT cp2 RoPE local positions": ("layers.0.attention.sdpa", "forward", 1),
    "MUT cp2 loss tokens per cp rank": ("output", "backward", 1),
    "MUT qwen3 tp2_sp q/k norms ReplicateParallel": ("layers.0.attention.q_norm", "gradient", 1),
    "MUT muon fsdp2 Newton-Schulz on the local shard": ("layers.0.attention.wq", "update", 1),
    "MUT muon gpt2 tp2 c_attn orthogonalized as one matrix": ("layers.0.attn.c_attn", "update", 1),
    "MUT muon tp2 owner's result not scattered": ("layers.0.attention.wq", "update", 1),
    "MUT block cp2 rank 1 ignores documents": ("layers.0.attention.sdpa", "forward", 1),
    "MUT gpt2 block fsdp2 positions not reset": ("layers.0.ln_1", "forward", 1),
    "moe ep2": None,
    "moe tp2_sp_ep2": None,
    "MUT moe tp2_sp_ep2 router not summed over tp": ("layers.1.moe.router.gate", "gradient", 1),
    "MUT moe tp2_sp_ep2 aux counts not over tp": ("layers.1.moe", "backward", 1),
    "MUT moe ep2 bias update from local loads": ("layers.1.moe.router", "forward", 2),
    "MUT moe ep2 aux loss per rank": ("layers.1.moe.router.gate", "backward", 1),
    "MUT fsdp2 validation leaves FSDP unsharded": ("norm", "gradient", 2),
    # torch >= 2.15 restores the stage's buffers (the MoE loads) after its metadata inference: no bug there
    "MUT moe pp2 1F1B metadata inference counted as routed tokens": None
    if INFERENCE_RESTORES_BUFFERS
    else ("layers.1.moe.router", "forward", 2),
    "moe pp2 1F1B": None,
    "pp2 1F1B tied": None,
    "pp2 ZBVZeroBubble": None,
    "MUT pp2 microbatch loss / m": ("tok_embeddings", "gradient", 1),
    "MUT pp2 norm not reduced over stages": ("(gradient norm)", "gradient", 1),
    "MUT pp2 tied weight counted twice in norm": ("(gradient norm)", "gradient", 1),
    "MUT pp2 tied grads not summed": ("tok_embeddings", "gradient", 1),
    "MUT block pp2 ZBVZeroBubble microbatch given another's starts": ("layers.0.attention.sdpa", "forward", 1),
    "MUT moe ep2_fsdp4 expert FSDP averaging": ("layers.1.moe.experts", "gradient", 1),
    "MUT pp2 fsdp2 ZBVZeroBubble resharding after forward": ("layers.2.attention_norm", "gradient", 1),
    "MUT pp2 1F1B uneven split runs a boundary block twice": ("layers.3.attention_norm", "forward", 1),
    "pp2 tp2_sp 1F1B": None,
    "tp2_fsdp2": None,
    "cp2_fsdp2": None,
    "hsdp2x2": None,
    "tp2_sp_fsdp2": None,
    "cp2_tp2_sp": None,
    "MUT hsdp2x2 gradients averaged": ("tok_embeddings", "gradient", 1),
    "gpt_oss tp2_sp_ep2": None,
    "gpt_oss_block cp2": None,  # the sinks' input gradient is each cp rank's partial sum: not compared
    "hf_mistral_window fsdp2": None,
    "MUT gpt_oss fsdp2 window off by one": ("layers.0.attention.sdpa", "forward", 1),
    "MUT gpt_oss cp2 window on local positions": ("layers.0.attention.sdpa", "forward", 1),
    "MUT gpt_oss_block cp2 sinks dropped": ("layers.0.attention.sdpa", "forward", 1),
    "MUT gpt_oss tp2_sp_ep2 sinks not split with their heads": ("layers.0.attention.sdpa", "forward", 1),
    "MUT gpt_oss ep2 clamp missing": ("layers.0.moe", "forward", 1),
    "MUT hf_mistral_window fsdp2 window dropped": ("layers.0.self_attn.o_proj", "forward", 1),
    "ds ep2": None,
    "ds tp2_sp_ep2": None,  # MTP: the tuple output, the depth's loss weighted as the layout's
    "ds cp2_ep2": None,  # the gathered latent's input gradient (wkv_b) is each cp rank's partial sum: not compared
    "MUT ds fsdp2 RoPE on the non-rope part": ("layers.0.attention.core", "forward", 1),
    "MUT ds_cp cp2 latent without the RoPE key": ("layers.0.attention.core", "forward", 1),
    "MUT ds cp2 MTP labels shifted per rank": ("output", "backward", 1),
    "MUT ds fsdp2 latent norm before the split": ("layers.0.attention.k_rope", "forward", 1),
    "MUT ds ep2 correction bias in the weights": ("layers.1.moe.router", "forward", 2),
    "MUT ds ep2 group limiting skipped": ("layers.1.moe.router", "forward", 1),
    "MUT ds fsdp2 MTP targets shifted by one": ("output", "backward", 1),
    "MUT ds tp2_sp_ep2 latent norm gradient not summed": ("mtp.1.block.attention.k_rope", "backward", 1),
    "MUT ds tp2_sp_ep2 MTP eh_proj gradient not summed": ("mtp.1.eh_proj", "gradient", 1),
    "MUT ds pp2 1F1B MTP tokens of another microbatch": ("mtp.1.embed", "forward", 1),
    "ddp2 zero1": None,
    "MUT ddp2 zero1 shards not all-gathered": ("tok_embeddings", "update", 1),
    "MUT fsdp2 cpu offload stale device copy": ("tok_embeddings", "forward", 2),
    "MUT fsdp2 act offload stale tensor": ("layers.1.feed_forward.w3", "backward", 1),
    "a2a cp2": None,
    "ring cp2": None,
    "MUT a2a cp2 heads scattered back in the wrong order": ("layers.0.attention.sdpa", "forward", 1),
    "MUT a2a cp2 reverse all-to-all skipped in backward": ("layers.1.attention.sdpa", "backward", 1),
    "MUT a2a gpt_oss cp2 every rank uses the first heads' sinks": ("layers.0.attention.sdpa", "forward", 1),
    "MUT ring cp2 a ring step skipped": ("layers.0.attention.sdpa", "forward", 1),
    "MUT ring cp2 log-sum-exps merged by max": ("layers.0.attention.sdpa", "forward", 1),
    "MUT ring cp2 dK / dV not passed home": ("layers.1.attention.sdpa", "backward", 1),
    "MUT ring gpt_oss_block cp2 sinks dropped": ("layers.0.attention.sdpa", "forward", 1),
    "MUT ring gpt_oss cp2 a window step skipped": ("layers.0.attention.sdpa", "forward", 1),
    "MUT ring ds_cp cp2 visiting up-projection grads dropped": ("layers.0.attention.wkv_b", "gradient", 1),
    "qnext_block cp2": None,
    "qnext tp2_sp_ep2": None,
    "MUT qnext cp2 state not passed": ("layers.0.linear_attn.core", "forward", 1),
    "MUT qnext cp2 scan in placement order": ("layers.0.linear_attn.conv_core", "forward", 1),
    "MUT qnext cp2 conv halo missing": ("layers.0.linear_attn.conv_core", "forward", 1),
    "MUT qnext_block cp2 state not reset at a document start": ("layers.0.linear_attn.core", "forward", 1),
    "MUT qnext fsdp2 decay sign flipped": ("layers.0.linear_attn.decay", "forward", 1),
    "MUT qnext fsdp2 beta not a sigmoid": ("layers.0.linear_attn.decay", "forward", 1),
    "MUT qnext ep2 shared-expert gate missing": ("layers.0.moe", "forward", 1),
    "MUT qnext tp2_sp_ep2 delta norm ReplicateParallel": ("layers.0.linear_attn.norm", "gradient", 1),
}
# where each mutation acts, for the cases the first point is not that module itself: the loss (no module) shows in
# the output projection's backward; the gradient norm is its own point; plain ColwiseParallel on the fused c_attn
# keeps a contiguous shard (equal to the weight's cut), the heads mix in the attention core right after it; GPT-2's
# positions are added in the model's forward, before layers.0.ln_1. A mutation in a module's own forward code
# between its submodules (MLA's RoPE and latent norm, transformers' attention mask) shows at the first submodule
# whose input it changed, the hint naming the enclosing module (PARENT_HINTS). Loss mutations (the MTP depth's
# labels) show in the output projection's backward. The MoE experts' permuted tokens have no cut of the one-device
# tensor: the clamp inside them shows at the MoE block's output. The correction bias is zero at step 1: it acts in
# step 2's routing. The router sees the batch's tokens flattened (rows x sequence), compared as this rank's rows'
# tokens: a wrong expert-bias update shows in the next step's routing, the aux loss in the router's gate's backward.

_RESULTS: dict[int, dict] = {}


def results(world_size: int, tmp_path_factory) -> dict:
    if world_size not in _RESULTS:
        out = tmp_path_factory.mktemp("localize") / f"loc{world_size}.json"
        r = run_script(HERE / "localize_worker.py", "--world-size", str(world_size), "--out", str(out), timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        _RESULTS[world_size] = json.loads(out.read_text())
    return _RESULTS[world_size]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_localised(name, tmp_path_factory):
    from localize_worker import CASES

    r = results(CASES[name][0], tmp_path_factory)[name]
    want = EXPECTED[name]
    if want is None:
        assert r["code"] == 0, r["text"]
        assert r["text"].startswith("no divergence above 1e-10 in 2 steps ("), r["text"]
        return
    fqn, phase, step = want
    assert r["code"] == 1, r["text"]
    first = r["text"].splitlines()[0]
    assert first.startswith(f"divergence: {fqn} {phase}: step {step}, microbatch "), first
    assert (r["first"]["fqn"], r["first"]["phase"], r["first"]["step"]) == want


# mutations inside a module's own forward code: the first point is a submodule, the hint names the module
PARENT_HINTS = {
    "MUT hf_mistral_window fsdp2 window dropped": ("layers.0.self_attn.o_proj", "layers.0.self_attn"),
    "MUT ds fsdp2 RoPE on the non-rope part": ("layers.0.attention.core", "layers.0.attention"),
    "MUT ds fsdp2 latent norm before the split": ("layers.0.attention.k_rope", "layers.0.attention"),
    "MUT cp2 RoPE local positions": ("layers.0.attention.sdpa", "layers.0.attention"),
    "MUT gpt2 block fsdp2 positions not reset": ("layers.0.ln_1", "layers.0"),
}


@pytest.mark.parametrize("name", list(PARENT_HINTS))
def test_parent_hint(name, tmp_path_factory):
    from localize_worker import CASES

    r = results(CASES[name][0], tmp_path_factory)[name]
    fqn, parent = PARENT_HINTS[name]
    assert r["hint"].startswith(f"{fqn}'s input 0 already differs (max |diff| "), r["hint"]
    assert r["hint"].endswith(f"the divergence arose before it, in {parent}'s forward code around its submodules")


# the MTP depth's labels: the output head's second call of the step (the depth's logits), not the next-token one
CALLS = {
    "MUT ds fsdp2 MTP targets shifted by one": "input 0, call 2 of 2",
    "MUT ds cp2 MTP labels shifted per rank": "input 0, call 2 of 2",
}


@pytest.mark.parametrize("name", list(CALLS))
def test_mtp_call(name, tmp_path_factory):
    from localize_worker import CASES

    r = results(CASES[name][0], tmp_path_factory)[name]
    assert r["first"]["what"] == CALLS[name], r["text"]


def test_every_mutation_has_a_case():
    """Every planted mutation of the gates (gate.MUTATIONS, pipeline_gate's included) is localised by a case here,
    and every case has its expected first point."""
    sys.path.insert(0, str(HERE.parent / "parallel"))
    import gate
    import pipeline_gate  # noqa: F401 - registers the pipeline mutations
    from localize_worker import CASES, NOT_LOCALISED

    planted = {mutation for _, _, mutation in CASES.values() if mutation}
    assert sorted(set(gate.MUTATIONS) - planted - set(NOT_LOCALISED)) == []
    assert sorted(set(CASES) ^ set(EXPECTED)) == []
    assert all((EXPECTED[name] is None) == (CASES[name][2] is None) for name in CASES)


HINTS = {
    "MUT tp2 no f backward all-reduce": "the 2 tp ranks' gradients sum to the reference: a partial sum never reduced "
    "over tp in layers.1.feed_forward",
    "MUT tp2_sp norms not sequence-parallel": "the 2 tp ranks' gradients sum to the reference",
    "MUT qwen3 tp2_sp q/k norms ReplicateParallel": "the 2 tp ranks' gradients sum to the reference: a partial sum "
    "never reduced over tp in layers.0.attention.q_norm",
    "MUT fsdp2 gradients averaged": "tok_embeddings's gradient is 0.5 x the reference: divided by 2",
    "MUT hsdp2x2 gradients averaged": "tok_embeddings's gradient is 0.25 x the reference: divided by 4",
    "MUT pp2 microbatch loss / m": "tok_embeddings's gradient is 0.25 x the reference: divided by 4",
    "MUT tp2_sp to_empty drops the gradient hooks": "the gradient's placement (tp: R) is not the "
    "parameter's (tp: S(0))",
    "MUT pp2 norm not reduced over stages": "every gradient agrees but the global gradient norm does not",
    "MUT ds tp2_sp_ep2 latent norm gradient not summed": "the 2 tp ranks' gradients sum to the reference: a partial "
    "sum never reduced over tp in mtp.1.block.attention.k_rope",
    "MUT qnext fsdp2 decay sign flipped": "layers.0.linear_attn.decay's forward tensor is -1 x the reference",
    "MUT qnext tp2_sp_ep2 delta norm ReplicateParallel": "the 2 tp ranks' gradients sum to the reference: a partial "
    "sum never reduced over tp in layers.0.linear_attn.norm",
}


@pytest.mark.parametrize("name", list(HINTS))
def test_hint(name, tmp_path_factory):
    from localize_worker import CASES

    r = results(CASES[name][0], tmp_path_factory)[name]
    assert r["hint"].startswith(HINTS[name]), r["hint"]
    assert f"hint: {r['hint']}" in r["text"].splitlines()
