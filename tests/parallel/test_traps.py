"""Issue 26, no silent traps for user modules: each trap a one-line error, on modules written the way outside users
write them (real ``transformers`` models from tiny float64 configs, a user's own pipeline model), and the correct
plans equal to one process. The multi-rank cases run in ONE 2-rank launch (traps_worker.py); the rest here."""

import pytest
import shared_launch
import torch
from torch import nn

TOL = 1e-10


def one_line(message: str | None) -> str:
    assert message is not None, "expected an error, got none"
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    everyone = shared_launch.results("traps", 2, request, tmp_path_factory)  # in the session's 2-rank launch
    print("\ntraps, rank 0:", everyone[0])
    return everyone


@pytest.fixture(scope="module")
def result(ranks):
    return ranks[0]


def test_the_documented_transformers_example_equals_one_process(ranks):
    for r in ranks:
        for key, diff in r["example"].items():
            assert diff <= TOL, f"{key}: {diff:.1e}"


def test_per_head_norms_as_replicate_are_refused_at_step_1(ranks):
    for r in ranks:  # the same line on every rank, before any wrong update
        msg = one_line(r["misplan_error"])
        assert msg.startswith("RuntimeError: ReplicateParallel on 'model.layers.0.self_attn.q_norm' (Qwen3RMSNorm)")
        assert "input differs" in msg and "HeadNormParallel(heads_dim=" in msg


def test_the_check_is_what_catches_it(result):
    # trusted (check="never"), the mis-plan trains wrong with no error: the norm weights' gradients are per rank
    assert result["misplan_unchecked_grad"] > 1e-6
    # the debug mode then also sees the replicated weights drifted apart
    msg = one_line(result["misplan_always_error"])
    assert "q_norm" in msg and "input and parameter 'weight' differ" in msg


def test_the_replica_check_costs_one_small_all_reduce_per_module(result):
    # first forward: one all-reduce of 2 x 5 float64 per ReplicateParallel module (plain inputs); then none
    n = result["replicate_modules"]
    assert result["check_comm_first"].get("c10d.allreduce_") == n == 5
    assert "c10d.allreduce_" not in result["check_comm_second"]
    first = {k: v for k, v in result["check_comm_first"].items() if k != "c10d.allreduce_"}
    assert first == result["check_comm_second"]  # the model's own collectives are unchanged


def test_a_positional_prepare_module_input_on_a_keyword_call_names_the_module(result):
    msg = one_line(result["keyword_error"])
    assert "'model.layers.0.self_attn' (Qwen3Attention)" in msg and "input_kwarg_layouts=" in msg
    assert "hidden_states" in msg
    assert result["keyword_form_grad"] <= TOL  # the documented input_kwarg_layouts= form on the same calls


def test_a_fused_projection_refuses_a_sequence_shard_taken_for_the_replica(result):
    msg = one_line(result["fused_input_error"])
    assert msg.startswith("RuntimeError: FusedColwiseParallel on 'h.0.attn.c_attn' (Linear): its input differs")
    assert "PrepareModuleInput(input_layouts=Shard(1)" in msg


def test_tp_must_divide_the_head_counts(result):
    msg = one_line(result["head_count_error"])
    assert msg.startswith("ValueError: apply_tp: tp 2 does not divide the head counts of Phi3ForCausalLM")
    assert "config.num_key_value_heads = 1" in msg


def test_fsdp_on_the_inner_decoder_is_refused_naming_the_head(result):
    msg = one_line(result["coverage_error"])
    assert "parameter(s) lm_head.weight:" in msg and "apply_fsdp to the root module" in msg
    assert result["coverage_unchecked_grad_norm"] > 1e-3  # what it silently gave before (issue: off by 0.35)
    assert result["coverage_root_loss"] <= TOL and result["coverage_root_grad_norm"] <= TOL  # the fix is exact


def test_blocks_that_split_a_tie_are_refused_at_apply_fsdp(result):
    msg = one_line(result["split_tie_error"])
    assert "model.embed_tokens.weight = lm_head.weight" in msg


def test_fsdp_lists_form_one_group_holding_nanogpts_tied_pair_and_trains_like_one_process(ranks):
    """torch's list form, blocks=[[model.transformer.wte, model.lm_head], *model.transformer.h], on karpathy's
    nanoGPT (it died with "'list' object has no attribute 'modules'" at the tie check): 3 AdamW steps on dp2."""
    for r in ranks:
        assert r["fsdp_list_tied"], "the tie survives"
        for key in ("fsdp_list_loss", "fsdp_list_grads", "fsdp_list_weights"):
            assert r[key] <= TOL, f"{key}: {r[key]:.1e}"


def test_a_shared_pipeline_module_with_a_parameter_trains_like_one_process(ranks):
    for r in ranks:
        assert r["shared_gain_here"], "every stage holds the shared module"
        assert r["shared_loss"] <= TOL and r["shared_weights"] <= TOL, r


# ------------------------------------------------------------------------------------------------ one process
def test_train_step_refuses_a_plain_loss_function():
    from titanlike.parallel import ScaledLoss, plain_clip_grad_norm_
    from titanlike.training.step import train_step

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    batch = [(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))]

    def summed(out, labels):
        return torch.nn.functional.cross_entropy(out, labels, reduction="sum")

    with pytest.raises(TypeError) as e:
        train_step([model], opt, batch, summed, max_norm=0.0, clip_fn=plain_clip_grad_norm_)
    msg = one_line(str(e.value))
    assert "ScaledLoss(loss_fn)" in msg and "from titanlike.parallel import ScaledLoss" in msg
    assert model.weight.grad is None  # refused before any forward
    res = train_step([model], opt, batch, ScaledLoss(summed), max_norm=0.0, clip_fn=plain_clip_grad_norm_)
    assert res.tokens == 2


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def _pipeline_error(model, split, **kw) -> str:
    from titanlike.parallel import pipeline_module

    # the dry run comes before anything touches the pp mesh (None here): the same error on every rank
    with pytest.raises(ValueError) as e:
        pipeline_module(model, None, split, loss_fn=None, n_microbatches=2, **kw)
    return one_line(str(e.value))


def test_a_stage_calling_a_none_child_is_refused_at_build_time():
    from traps_worker import ROPE_SPLIT, RopeNet

    msg = _pipeline_error(RopeNet(learned=False), ROPE_SPLIT)
    assert msg.startswith("pipeline_module: stage 0's forward calls 'rope' ('pos = self.rope(x.shape[1])')")
    assert "shared=['rope']" in msg and "is not None" in msg
    # the case: a transformers model (its forward does not skip None children)
    split = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    msg = _pipeline_error(_qwen3(), split)
    assert "calls 'model.rotary_emb'" in msg and "shared=['model.rotary_emb']" in msg
    msg = _pipeline_error(_qwen3(), split, shared=["model.rotary_emb"])
    assert "stage 0's forward calls 'model.norm'" in msg and "on stage 1" in msg


def test_the_dry_run_passes_a_model_that_keeps_the_contract():
    import nanogpt_parallel as ex

    from titanlike.parallel.pipeline import dry_run

    model = ex.GPT(ex.GPTConfig())
    dry_run(model, ex.SPLIT)  # no error; nothing was allocated or changed
    assert all(not p.is_meta for p in model.parameters())


def test_style_arguments_are_validated():
    from titanlike.parallel import FusedColwiseParallel, HeadNormParallel, ReplicateParallel

    for style in (ReplicateParallel, lambda check: FusedColwiseParallel(3, check=check)):
        with pytest.raises(ValueError, match="check must be one of"):
            style(check="sometimes")
    assert repr(HeadNormParallel(heads_dim=2)) == "HeadNormParallel(heads_dim=2, use_local_output=True)"


# ------------------------------------------------------------------ nanoGPT as its author wrote it (issue 38)
def test_a_dropped_moduledict_entry_is_named_by_the_dry_run():
    """karpathy's nanoGPT reaches its modules through the ModuleDict ``transformer``: stage 0, whose ln_f (on stage
    1) is deleted from the ModuleDict, is refused by the dry run naming ``transformer.ln_f``, not by an
    AttributeError in stage 0's first forward after the stages were built."""
    from karpathy_nanogpt import GPT, GPTConfig

    split = [
        ["transformer.wte", "transformer.wpe", "transformer.h.0"],
        ["transformer.h.1", "transformer.ln_f", "lm_head"],
    ]
    msg = _pipeline_error(GPT(GPTConfig()), split)
    assert msg.startswith(
        "pipeline_module: stage 0's forward calls 'transformer.ln_f' ('x = self.transformer.ln_f(x)')"
    ), msg
    assert "which is on stage 1" in msg and "not in its ModuleDict 'transformer'" in msg, msg
    assert "if 'ln_f' in self.transformer" in msg, msg


def test_apply_pp_on_an_unregistered_model_names_pipeline_module():
    from karpathy_nanogpt import GPT, GPTConfig

    from titanlike.config import load_config
    from titanlike.parallel.pipeline import apply_pp

    with pytest.raises(ValueError) as e:
        apply_pp(GPT(GPTConfig()), None, load_config([]), torch.device("cpu"))
    msg = one_line(str(e.value))
    assert msg.startswith("apply_pp: GPT is not a registered model") and "pipeline_module(model, pp_mesh" in msg


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_dry_run_of_a_transformers_model_gives_one_verdict_with_or_without_cache(use_cache):
    """transformers calls .item() on a meta tensor with use_cache=False (find_packed_sequence_indices): the dry run
    reruns that stage on fake tensors, which transformers' is_tracing skips, and reaches the same verdict."""
    split = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    model = _qwen3()
    model.config.use_cache = use_cache
    msg = _pipeline_error(model, split)
    assert "stage 0's forward calls 'model.rotary_emb'" in msg and "shared=['model.rotary_emb']" in msg, msg
