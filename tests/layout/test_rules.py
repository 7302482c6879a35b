"""Every layout rule, one bad configuration each: the rule fires, and ``train.py``'s entry point refuses the
configuration with exit code 2 and one line on stderr, before any process group exists."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from hf_models import hf_folder

from titanlike.config import model_args_from_config, parse_config
from titanlike.layout import RULES
from titanlike.layout.rules import rule_violations
from titanlike.models import get_spec
from titanlike.models.spec import _REGISTRY
from titanlike.training.trainer import main

TINY = ["--model.flavor", "tiny", "--training.seq_len", "16", "--training.local_batch_size", "4"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
GPT2 = ["--model.name", "gpt2"]
# A model registered from outside that does not declare context parallelism (every built-in model does).
NO_CP = dataclasses.replace(get_spec("llama3"), name="llama3_without_cp", context_parallel=False)
MOE = ["--model.name", "qwen3_moe"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
HF_MODEL = hf_folder("hf_qwen2_tied", vocab_size=2048)
NO_PLAN = hf_folder("hf_qwen2_tied", vocab_size=2048, base_model_tp_plan={})
INV = ["--training.layout_invariant", "true"]
ZB = [*PP2, "--model.n_layers", "4", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]

# rule -> (world size, the bad options on top of TINY)
CASES = {
    "dim_heads": (1, ["--model.dim", "36", "--model.n_heads", "8", "--model.n_kv_heads", "8"]),
    "heads_kv": (1, ["--model.n_heads", "4", "--model.n_kv_heads", "3"]),
    "model_keys": (1, [*GPT2, "--model.rope_theta", "10000"]),  # GPT-2 has learned positions, no RoPE
    "model_shape": (1, ["--model.dim", "36", "--model.n_heads", "4", "--model.n_kv_heads", "4"]),  # head_dim odd
    "seq_len_max": (1, ["--training.seq_len", "512"]),
    "degrees": (4, ["--parallelism.tensor_parallel_degree", "3"]),
    "cp_seq_len": (2, [*CP2, "--training.seq_len", "14"]),
    "cp_sp_seq_len": (
        8,
        [
            *CP2,
            "--parallelism.tensor_parallel_degree",
            "4",
            "--parallelism.enable_sequence_parallel",
            "--model.n_heads",
            "8",
            "--model.n_kv_heads",
            "4",
            "--training.seq_len",
            "12",
        ],
    ),
    "mask_reset": (1, ["--model.reset_position_ids", "true"]),
    "cp_kernels": (2, [*CP2, "--model.kernels", "te"]),
    "cp_method_needs_cp": (1, ["--parallelism.context_parallel_method", "alltoall"]),
    # the 2 heads of a tp rank (4 / tp 2) cannot split over cp 4
    "cp_heads": (
        8,
        [
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.context_parallel_method",
            "alltoall",
        ],
    ),
    # hybrid with an all-to-all group of the whole cp group: the alltoall method
    "cp_a2a_degree": (2, [*CP2, "--parallelism.context_parallel_method", "hybrid"]),
    "cp_float8": (2, [*CP2, "--float8.recipe", "tensorwise"]),
    "cp_model": (2, ["--model.name", NO_CP.name, *CP2]),
    "te_model": (1, [*GPT2, "--model.kernels", "te"]),
    "float8_model": (1, [*GPT2, "--float8.recipe", "tensorwise"]),
    # a transformers model whose config declares no tensor-parallel plan (model.name = "hf")
    "mask_model": (1, ["--model.name", "hf", "--model.hf_config", HF_MODEL, "--model.attn_mask_type", "block_causal"]),
    "tp_plan": (2, ["--model.name", "hf", "--model.hf_config", NO_PLAN, "--parallelism.tensor_parallel_degree", "2"]),
    "tp_heads": (8, ["--parallelism.tensor_parallel_degree", "8"]),
    "tp_kv_heads": (4, ["--parallelism.tensor_parallel_degree", "4"]),
    # Qwen3-Next tiny: 2 Gated DeltaNet key heads, the attention's 4 heads / 4 kv heads split by 4
    "tp_model": (
        4,
        ["--model.name", "qwen3_next", "--model.n_kv_heads", "4", "--parallelism.tensor_parallel_degree", "4"],
    ),
    "tp_ffn": (2, ["--parallelism.tensor_parallel_degree", "2", "--model.ffn_hidden_dim", "91"]),
    "tp_vocab": (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "gpt2_small", "--model.vocab_multiple", "1"],
    ),
    "sp_seq_len": (
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            "--training.seq_len",
            "15",
        ],
    ),
    "sp_needs_tp": (1, ["--parallelism.enable_sequence_parallel"]),
    "te_tp": (2, ["--parallelism.tensor_parallel_degree", "2", "--model.kernels", "te"]),
    "batch": (2, ["--training.global_batch_size", "6"]),
    "pp_names_need_pp": (
        1,
        ["--parallelism.pipeline_parallel_module_names", "tok_embeddings,layers.0;layers.1,norm,output"],
    ),
    "ac_option": (
        1,
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "+2"],
    ),
    "float8": (1, ["--float8.recipe", "delayed"]),  # a TE recipe with the torchao backend
    "muon": (1, ["--optimizer.momentum", "0.9"]),  # a Muon-only key under AdamW
    "pp_stages_divide": (
        4,
        ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_layers_per_stage", "1"],
    ),
    "pp_single_stage": (2, [*PP2, "--model.n_layers", "4", "--parallelism.pipeline_parallel_stages_per_rank", "2"]),
    "pp_v_two_stages": (2, [*ZB, "--parallelism.pipeline_parallel_stages_per_rank", "1"]),
    "pp_multi_stage": (
        2,
        [
            *PP2,
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "1",
        ],
    ),
    "pp_module_names": (
        2,
        [*PP2, "--parallelism.pipeline_parallel_module_names", "tok_embeddings,layers.1;layers.0,norm,output"],
    ),
    "pp_layers_per_stage": (
        2,
        [
            *PP2,
            "--parallelism.pipeline_parallel_layers_per_stage",
            "2",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "1",
        ],
    ),
    # 3 layers in DualPipeV's 2 x 2 stages: one stage would be empty
    "pp_empty_stage": (2, [*PP2, "--model.n_layers", "3", "--parallelism.pipeline_parallel_schedule", "DualPipeV"]),
    "pp_end_weights": (2, [*PP2, "--parallelism.pipeline_parallel_first_stage_less_layers", "3"]),
    "pp_microbatch_size": (2, [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "3"]),
    "pp_microbatches": (2, [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "4"]),
    "zb_reshard": (2, [*ZB, "--parallelism.fsdp_reshard_after_forward", "always"]),
    "zb_op_ac": (2, [*ZB, "--activation_checkpoint.mode", "selective"]),
    "zb_compile": (2, [*ZB, "--compile.enable"]),
    "zb_latent_ring": (
        4,
        [
            *ZB,
            "--model.name",
            "deepseek_v3",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.context_parallel_method",
            "ring",
        ],
    ),
    "ep_degree": (4, [*MOE, "--parallelism.expert_parallel_degree", "3"]),
    "ep_model": (2, EP2),  # llama3 has no experts
    "ep_experts": (4, [*MOE, "--parallelism.expert_parallel_degree", "4", "--model.num_experts", "6"]),
    "moe_tp": (2, [*MOE, "--parallelism.tensor_parallel_degree", "2"]),
    "ep_dispatch": (1, ["--parallelism.expert_dispatch", "padded"]),
    "export_model": (1, [*MOE, "--checkpoint.enable", "--checkpoint.export_safetensors"]),
    "mtp_layout": (1, ["--model.name", "deepseek_v3", "--training.mtp_loss_weight", "-1"]),
    "sdc": (1, ["--training.sdc_check_interval", "5"]),  # one process: nothing to compare
    "invariant_virtual_dp": (1, [*INV, "--training.virtual_dp_degree", "6"]),
    "invariant_batch": (1, [*INV, "--training.global_batch_size", "16"]),  # V 8 x local batch 4 = 32 per step
    "invariant_layout": (2, [*INV, "--parallelism.tensor_parallel_degree", "2"]),
    "cpu_offload": (1, ["--training.enable_cpu_offload", "true"]),  # one process: no FSDP shards to offload
    "zero1": (2, ["--parallelism.distributed_optimizer", "true"]),  # dp 2 by FSDP (shard 2): no replicas
    "act_offload": (2, ["--activation_checkpoint.offload", "true", "--parallelism.tensor_parallel_degree", "2"]),
}

# further cases of a rule that guards several things
MORE_CASES = [
    # the a2a degree with another method (nothing would read it), one that does not divide cp, hybrid's head split
    ("cp_a2a_degree", (2, [*CP2, "--parallelism.context_parallel_a2a_degree", "2"])),
    (
        "cp_a2a_degree",
        (
            6,
            [
                "--parallelism.context_parallel_degree",
                "6",
                "--training.seq_len",
                "24",
                "--parallelism.context_parallel_method",
                "hybrid",
                "--parallelism.context_parallel_a2a_degree",
                "4",
            ],
        ),
    ),
    (
        "cp_heads",
        (
            8,
            [
                "--parallelism.context_parallel_degree",
                "8",
                "--parallelism.context_parallel_method",
                "hybrid",
                "--parallelism.context_parallel_a2a_degree",
                "4",
                "--parallelism.tensor_parallel_degree",
                "1",
                "--model.n_heads",
                "2",
                "--model.n_kv_heads",
                "2",
                "--model.dim",
                "32",
            ],
        ),
    ),
    # activation offload inside compiled blocks (dynamo does not trace the saved-tensor hooks)
    ("act_offload", (1, ["--activation_checkpoint.offload", "true", "--compile.enable", "true"])),
    # layout invariance: dp 4 does not divide V 2; V set without layout_invariant (read by nothing); Muon, pp x tp
    ("invariant_virtual_dp", (4, [*INV, "--training.virtual_dp_degree", "2"])),
    ("invariant_virtual_dp", (1, ["--training.virtual_dp_degree", "16"])),
    ("invariant_layout", (1, [*INV, "--optimizer.name", "Muon"])),
    ("invariant_layout", (4, [*INV, *PP2, "--parallelism.tensor_parallel_degree", "2"])),
    ("model_shape", (1, [*MOE, "--model.top_k", "9"])),  # the MoE block's own checks (8 experts)
    # MTP: the weight set for a model without depths (read by nothing), depths beyond the sequence
    ("mtp_layout", (1, ["--training.mtp_loss_weight", "0.5"])),
    ("cpu_offload", (4, ["--training.enable_cpu_offload", "true", *PP2])),  # FSDP 2 x pp 2: not wired yet
    (
        "zero1",
        (
            2,
            [
                "--parallelism.distributed_optimizer",
                "true",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--optimizer.name",
                "Muon",
            ],
        ),
    ),
    ("sdc", (2, ["--parallelism.tensor_parallel_degree", "2", "--training.sdc_check_interval", "-1"])),
    ("sdc", (4, ["--training.sdc_check_interval", "2"])),  # FSDP over 4: every shard held once
    ("sdc", (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.sdc_check_interval", "2"])),  # untied
    ("mtp_layout", (1, ["--model.name", "deepseek_v3", "--model.mtp_layers", "2", "--training.seq_len", "2"])),
    # tp with experts needs SP and ep > 1 (ep borrows the tp ranks): SP without ep is refused too
    ("moe_tp", (2, [*MOE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"])),
    (
        "model_shape",
        (
            1,
            [
                "--model.rope_scaling",
                "llama3",
                "--model.rope_scaling_factor",
                "8",
                "--model.rope_low_freq_factor",
                "4",
                "--model.rope_high_freq_factor",
                "1",
                "--model.rope_original_max_seq_len",
                "8192",
            ],
        ),
    ),
]


def test_every_rule_has_a_case():
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize(
    "rule,case",
    [*sorted(CASES.items()), *MORE_CASES],
    ids=[*sorted(CASES), *(f"{r}-{i}" for i, (r, _) in enumerate(MORE_CASES))],
)
def test_each_rule_fires_and_train_py_exits_2_with_one_line(rule, case, monkeypatch, capsys):
    world, bad = case
    monkeypatch.setitem(_REGISTRY, NO_CP.name, NO_CP)
    argv = TINY + bad
    cfg = parse_config(argv)
    fired = rule_violations(cfg, world, model_args_from_config(cfg))
    assert rule in {name for name, _ in fired}, fired
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    messages = [m for _, m in fired]  # every problem of the input in the one line (numbered when several)
    listed = "; ".join(f"({i}) {m}" for i, m in enumerate(messages, 1))
    assert err[0].removeprefix("error: ") == (
        messages[0] if len(messages) == 1 else f"{len(messages)} problems: {listed}"
    )
    assert not dist.is_initialized()


def test_a_good_configuration_breaks_no_rule():
    cfg = parse_config(TINY)
    assert rule_violations(cfg, 1, model_args_from_config(cfg)) == []


@pytest.mark.parametrize(
    "world,extra",
    [(1, []), (2, []), (4, ["--parallelism.data_parallel_replicate_degree", "2"]), (4, PP2), (4, ZB), (2, ZB)],
)
def test_a_layout_invariant_configuration_breaks_no_rule(world, extra):
    """One process, FSDP 2, HSDP 2x2, pp 2 x FSDP 2 (1F1B, ZBVZeroBubble) and pp 2 alone with a split-backward V
    schedule, with the default V 8: global batch -1 is local batch x V on every layout."""
    cfg = parse_config([*TINY, *INV, *extra])
    assert rule_violations(cfg, world, model_args_from_config(cfg)) == []
