"""The pipeline-parallel part of the equality gate: every schedule, tied embeddings, PP x FSDP x TP, in float64.

    python tests/parallel/pipeline_gate.py --world-size 4 --out pp4.json [--only NAME,NAME]

Extends ``tests/parallel/gate.py`` without changing it: registers the ``"pp"`` builder (``apply_pp`` exactly
as the trainer calls it), deeper models (8 blocks: pp 4 x 2 stages per rank needs a block per stage) and the
pipeline mutations, then runs gate.py's ``run_layout`` (3 AdamW steps with clipping that acts, loss / grad norm /
every gradient and weight against one device, <= 1e-10) for each layout of this world size in one process group.
On top, each layout checks the validation loss (``PipelineParallel.eval_loss``) before training, which training
must survive, and after the last step, against the one-device model with the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import sys
import time
from functools import partial
from pathlib import Path

import gate  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gate import GLOBAL_BATCH, STEPS, TOL, Built, Layout, patched  # noqa: E402
from torch import nn  # noqa: E402

from titanlike.training.optim import build_optimizer  # noqa: E402

gate.MODELS.update(
    {
        "deep": ("--model.n_layers", "8"),
        "deep_tied": ("--model.n_layers", "8", "--model.tie_embeddings", "true"),
        "six": ("--model.n_layers", "6"),
        # 5 blocks: no pp 2 split is even (torchtitan's split: the first stages one block more)
        "five": ("--model.n_layers", "5"),
        # GPT-2 (tied embeddings across the first and last stage; fused c_attn; learned positions on the first stage).
        "gpt2_deep": ("--model.name", "gpt2", "--model.n_layers", "8"),
        # Qwen3 (per-head q/k norms, q wider than dim, tied embeddings across the first and last stage).
        "qwen3_deep": ("--model.name", "qwen3", "--model.n_layers", "8"),
        # tests/parallel/nanogpt.py: a user's module, not a registered model (gate.CUSTOM_MODELS); the config only
        # carries the run settings (4 blocks, as NanoGPT has, for the split checks).
        "nanogpt": ("--model.n_layers", "4"),
        # Muon (Newton-Schulz in float64): every stage orthogonalizes its own blocks' matrices over its dp x tp ranks
        "muon_deep": ("--model.n_layers", "8", *gate.MODELS["muon"]),
        # document masking (block_causal, positions reset per document): the starts travel with each microbatch
        "block_deep": ("--model.n_layers", "8", *gate.MODELS["block_reset"]),
        # Qwen3-MoE (every block MoE, bias update and aux loss on): each stage updates its own blocks' biases
        "moe_deep": ("--model.n_layers", "4", *gate.MODELS["moe"]),
        # gpt-oss (4 blocks: sliding, full, sliding, full; sinks; biased clamped experts), causal and block_causal
        "gpt_oss_deep": ("--model.n_layers", "4", *gate.MODELS["gpt_oss"]),
        "gpt_oss_block_deep": ("--model.n_layers", "4", *gate.MODELS["gpt_oss_block"]),
        # DeepSeek-V3 (MLA, a dense first layer, then MoE with the bias update, block_causal), the MTP depth on the
        # last stage (its embedding a tied copy of the first stage's table, the token ids passed to every stage)
        "ds_deep": ("--model.n_layers", "4", *gate.MODELS["ds_block"]),
        "ds_deep_nomtp": ("--model.n_layers", "4", *gate.MODELS["ds_cp_block"]),
        # Qwen3-Next (linear, full, linear, full): ZBV's 4 stages of one block each hold both layer kinds
        "qnext_deep": ("--model.n_layers", "4", *gate.MODELS["qnext"]),
        "qnext_block_deep": ("--model.n_layers", "4", *gate.MODELS["qnext_block"]),
    }
)
gate.MUON_MATRICES["muon_deep"] = 7 * 8


def _nanogpt():
    from nanogpt import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(vocab=gate.VOCAB, block_size=gate.SEQ).double()


gate.CUSTOM_MODELS["nanogpt"] = _nanogpt


def _llama(key: str) -> nn.Module:
    return gate.build_model(gate.config(Layout(key, 1, (), model=key), 1))


def _tie_unlisted() -> nn.Module:
    """A registered model with a tie its spec does not list: block 0's and block 7's w1 are one parameter (stage 0
    and the last stage hold one name each). Found by identity, summed like tied embeddings."""
    model = _llama("deep")
    model.layers["7"].feed_forward.w1.weight = model.layers["0"].feed_forward.w1.weight
    return model


def _spec_names_untied() -> nn.Module:
    """tie_embeddings = true in the arguments (the spec's tied pair), but the user gave the head its own weight:
    nothing is shared, nothing may be summed."""
    model = _llama("deep_tied")
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())
    return model


gate.MODELS.update({"deep_tie_unlisted": gate.MODELS["deep"], "deep_spec_names_untied": gate.MODELS["deep_tied"]})
gate.CUSTOM_MODELS.update({"deep_tie_unlisted": _tie_unlisted, "deep_spec_names_untied": _spec_names_untied})
NANO_SPLIT = [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]
NANO_SPLIT_V = [["wte", "wpe", "h.0"], ["h.1"], ["h.2"], ["h.3", "ln_f", "lm_head"]]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SP = ("--parallelism.enable_sequence_parallel", "true")


def _pp(degree: int, schedule: str, local_batch: int, microbatch: int = 1, *more: str) -> tuple[str, ...]:
    return (
        "--parallelism.pipeline_parallel_degree",
        str(degree),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--training.local_batch_size",
        str(local_batch),
        "--parallelism.pipeline_parallel_microbatch_size",
        str(microbatch),
        *more,
    )


def _tp2(*more: str) -> tuple[str, ...]:
    return ("--parallelism.tensor_parallel_degree", "2", *more)


def _layout(name, world, args, model="deep", mutation=None) -> Layout:
    return Layout(name, world, args, model=model, kind="pp", mutation=mutation)


# the families compiled under pp 2 x fsdp 2 on 4 ranks (llama: "compile pp2 1F1B" and gate.py's "compile fsdp2";
# qwen3_moe: MoE blocks without ep compile whole under FSDP), and under pp 2 alone on 2 ranks (their 4-rank compile
# cost the most of the gate's layouts: every rank compiles its own graphs)
COMPILED_FAMILIES = (
    ("gpt2", "gpt2_deep"),
    ("qwen3", "qwen3_deep"),
    ("moe", "moe_deep"),
)
COMPILED_FAMILIES_PP2 = (
    ("gpt_oss", "gpt_oss_deep"),
    ("ds", "ds_deep"),
    ("qnext", "qnext_deep"),
)
HAND = "tok_embeddings,layers.0;layers.1,layers.2,layers.3;layers.4,layers.5,layers.6;layers.7,norm,output"
LAYOUTS = [
    # 2 ranks: pure pp 2, 8 blocks, 8 rows -> 4 microbatches of 2.
    *[_layout(f"pp2 {s}", 2, _pp(2, s, 8, 2)) for s in SCHEDULES],
    _layout("pp2 1F1B tied", 2, _pp(2, "1F1B", 8, 2), model="deep_tied"),
    _layout("pp2 ZBVZeroBubble tied", 2, _pp(2, "ZBVZeroBubble", 8, 2), model="deep_tied"),
    _layout("pp2 1F1B accum2", 2, _pp(2, "1F1B", 4, 2)),
    # compiled blocks (fullgraph, aot_eager; test_pipeline_gate.py asserts no graph break, nothing compiled after
    # step 2)
    _layout("compile pp2 1F1B", 2, _pp(2, "1F1B", 8, 2, *gate.COMPILED)),
    *[
        _layout(f"compile {name} pp2 1F1B", 2, _pp(2, "1F1B", 8, 2, *gate.COMPILED), model=model)
        for name, model in COMPILED_FAMILIES_PP2
    ],
    # A breadth-first schedule runs fewer microbatches than ranks (layout rule pp_microbatches, ScheduleFacts).
    _layout("pp2 LoopedBFS 1 microbatch", 2, _pp(2, "LoopedBFS", 2, 2)),
    _layout(
        "pp2 Interleaved1F1B module_names",
        2,
        _pp(2, "Interleaved1F1B", 8, 2, "--parallelism.pipeline_parallel_module_names", HAND),
    ),
    _layout(
        "pp2 Interleaved1F1B less_layers 1+1",
        2,
        _pp(
            2,
            "Interleaved1F1B",
            8,
            2,
            "--parallelism.pipeline_parallel_first_stage_less_layers",
            "1",
            "--parallelism.pipeline_parallel_last_stage_less_layers",
            "1",
        ),
        model="six",
    ),
    _layout("MUT pp2 tied grads not summed", 2, _pp(2, "1F1B", 8, 2), "deep_tied", "pp_tied_not_summed"),
    _layout("MUT pp2 V tied grads not summed", 2, _pp(2, "ZBVZeroBubble", 8, 2), "deep_tied", "pp_tied_not_summed"),
    *[_layout(f"gpt2 pp2 {s} tied", 2, _pp(2, s, 8, 2), model="gpt2_deep") for s in SCHEDULES],
    _layout("MUT gpt2 pp2 tied grads not summed", 2, _pp(2, "1F1B", 8, 2), "gpt2_deep", "pp_tied_not_summed"),
    *[_layout(f"qwen3 pp2 {s} tied", 2, _pp(2, s, 8, 2), model="qwen3_deep") for s in SCHEDULES],
    # transformers models (model.name = "hf", 2 layers): the stages cut by the spec's roles, no user wrapper
    *[_layout(f"{m} pp2 1F1B", 2, _pp(2, "1F1B", 8, 2), model=m) for m in ("hf_phi3", "hf_qwen3", "hf_qwen2_tied")],
    _layout(
        "MUT hf_qwen2_tied pp2 tied grads not summed", 2, _pp(2, "1F1B", 8, 2), "hf_qwen2_tied", "pp_tied_not_summed"
    ),
    Layout("nanogpt pp2 1F1B user split tied", 2, _pp(2, "1F1B", 8, 2), model="nanogpt", kind="user_pp"),
    Layout(
        "nanogpt pp2 ZBVZeroBubble user split tied V", 2, _pp(2, "ZBVZeroBubble", 8, 2), model="nanogpt", kind="user_pp"
    ),
    Layout(
        "MUT nanogpt pp2 tied grads not summed",
        2,
        _pp(2, "1F1B", 8, 2),
        model="nanogpt",
        kind="user_pp",
        mutation="pp_tied_not_summed",
    ),
    _layout("pp2 1F1B tie under names the spec does not list", 2, _pp(2, "1F1B", 8, 2), model="deep_tie_unlisted"),
    _layout(
        "pp2 ZBVZeroBubble tie under names the spec does not list",
        2,
        _pp(2, "ZBVZeroBubble", 8, 2),
        model="deep_tie_unlisted",
    ),
    _layout("pp2 1F1B spec's tied names not tied", 2, _pp(2, "1F1B", 8, 2), model="deep_spec_names_untied"),
    _layout(
        "MUT pp2 tie under unlisted names not summed",
        2,
        _pp(2, "1F1B", 8, 2),
        "deep_tie_unlisted",
        "pp_tied_not_summed",
    ),
    _layout("MUT pp2 microbatch loss / m", 2, _pp(2, "1F1B", 8, 2), mutation="pp_loss_over_microbatches"),
    _layout("MUT pp2 norm not reduced over stages", 2, _pp(2, "1F1B", 8, 2), mutation="pp_norm_not_reduced"),
    _layout("MUT pp2 tied weight counted twice in norm", 2, _pp(2, "1F1B", 8, 2), "deep_tied", "pp_tied_norm_twice"),
    # 4 ranks: pure pp 4 (8 microbatches of 1), pp 2 x fsdp 2 (4 of 1), pp 2 x tp 2 (4 of 2).
    *[_layout(f"pp4 {s}", 4, _pp(4, s, 8)) for s in SCHEDULES],
    _layout("pp4 Interleaved1F1B tied", 4, _pp(4, "Interleaved1F1B", 8), model="deep_tied"),
    _layout("pp4 DualPipeV tied", 4, _pp(4, "DualPipeV", 8), model="deep_tied"),
    *[_layout(f"pp2 fsdp2 {s}", 4, _pp(2, s, 4)) for s in ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")],
    _layout("pp2 fsdp2 1F1B tied accum2", 4, _pp(2, "1F1B", 2), model="deep_tied"),
    # every family's blocks compiled (fullgraph, aot_eager) inside pp 2 x fsdp 2 stages: the MoE blocks without
    # expert parallelism (their experts FSDP-sharded like any weight) compile whole as well
    *[
        _layout(f"compile {name} pp2 fsdp2 1F1B", 4, _pp(2, "1F1B", 4, 1, *gate.COMPILED), model=model)
        for name, model in COMPILED_FAMILIES
    ],
    _layout("pp2 tp2 1F1B", 4, _tp2(*_pp(2, "1F1B", 8, 2))),
    _layout("pp2 tp2_sp Interleaved1F1B", 4, _tp2(*SP, *_pp(2, "Interleaved1F1B", 8, 2))),
    _layout("pp2 tp2_sp DualPipeV tied", 4, _tp2(*SP, *_pp(2, "DualPipeV", 8, 2)), model="deep_tied"),
    _layout(
        "pp2 fsdp2 1F1B reshard_after_forward always",
        4,
        _pp(2, "1F1B", 4, 1, "--parallelism.fsdp_reshard_after_forward", "always"),
    ),
    _layout(
        "MUT pp2 fsdp2 ZBVZeroBubble resharding after forward",
        4,
        _pp(2, "ZBVZeroBubble", 4),
        mutation="pp_fsdp_reshard_after_forward",
    ),
    _layout("gpt2 pp2 tp2_sp 1F1B tied", 4, _tp2(*SP, *_pp(2, "1F1B", 8, 2)), model="gpt2_deep"),
    _layout("gpt2 pp2 fsdp2 ZBVZeroBubble tied", 4, _pp(2, "ZBVZeroBubble", 4), model="gpt2_deep"),
    _layout("qwen3 pp2 tp2_sp 1F1B tied", 4, _tp2(*SP, *_pp(2, "1F1B", 8, 2)), model="qwen3_deep"),
    _layout(
        "qwen3 cp2 pp2 1F1B tied",
        4,
        ("--parallelism.context_parallel_degree", "2", *_pp(2, "1F1B", 8, 2)),
        model="qwen3_deep",
    ),
    Layout(
        "nanogpt pp2 tp2 1F1B user split and plan fused c_attn",
        4,
        _tp2(*_pp(2, "1F1B", 8, 2)),
        model="nanogpt",
        kind="user_pp",
    ),
    _layout("MUT pp4 tied grads not summed", 4, _pp(4, "Interleaved1F1B", 8), "deep_tied", "pp_tied_not_summed"),
    _layout("MUT pp4 norm not reduced over stages", 4, _pp(4, "1F1B", 8), mutation="pp_norm_not_reduced"),
    _layout(
        "cp2 pp2 1F1B tied", 4, ("--parallelism.context_parallel_degree", "2", *_pp(2, "1F1B", 8, 2)), model="deep_tied"
    ),
    # 8 ranks: pp 2 x fsdp 2 x tp 2 (+SP); 2 microbatches of 2 (DualPipeV needs 4 of 1).
    _layout("pp2 fsdp2 tp2_sp 1F1B", 8, _tp2(*SP, *_pp(2, "1F1B", 4, 2))),
    _layout("pp2 fsdp2 tp2_sp InterleavedZeroBubble", 8, _tp2(*SP, *_pp(2, "InterleavedZeroBubble", 4, 2))),
    _layout("pp2 fsdp2 tp2_sp DualPipeV", 8, _tp2(*SP, *_pp(2, "DualPipeV", 4))),
    _layout("pp2 fsdp2 tp2 GPipe tied", 8, _tp2(*_pp(2, "GPipe", 4, 2)), model="deep_tied"),
    _layout(
        "gpt2 pp2 fsdp2 tp2_sp Interleaved1F1B tied", 8, _tp2(*SP, *_pp(2, "Interleaved1F1B", 4, 2)), model="gpt2_deep"
    ),
    _layout("pp2 fsdp2 tp2_sp ZBVZeroBubble tied", 8, _tp2(*SP, *_pp(2, "ZBVZeroBubble", 4, 2)), model="deep_tied"),
    _layout(
        "qwen3 pp2 fsdp2 tp2_sp Interleaved1F1B tied",
        8,
        _tp2(*SP, *_pp(2, "Interleaved1F1B", 4, 2)),
        model="qwen3_deep",
    ),
    _layout("muon pp2 fsdp2 tp2_sp 1F1B", 8, _tp2(*SP, *_pp(2, "1F1B", 4, 2)), model="muon_deep"),
]
# Document masking under the pipeline schedules (the per-microbatch document starts: schedule.step's keyword
# tensors, split by microbatch like the inputs), incl. the zero-bubble / V ones.
LAYOUTS += [
    _layout(f"block pp2 {s}", 2, _pp(2, s, 8, 2), model="block_deep")
    for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
]
LAYOUTS += [
    _layout(
        "MUT block pp2 ZBVZeroBubble microbatch given another's starts",
        2,
        _pp(2, "ZBVZeroBubble", 8, 2),
        model="block_deep",
        mutation="pp_starts_other_microbatch",
    ),
]


# gpt-oss stages: the sliding-window and full layers with their sinks on different stages, causal (the forward's
# causal mask built per stage and microbatch) and block_causal (the starts travel with each microbatch)
LAYOUTS += [
    _layout(f"{m} pp2 {s}", 2, _pp(2, s, 8, 2), model=m)
    for m in ("gpt_oss_deep", "gpt_oss_block_deep")
    for s in ("1F1B", "ZBVZeroBubble", "DualPipeV")
]


# Qwen3-MoE stages: experts split over ep (borrowed from dp_shard) inside each stage, the trainer's bias update and
# aux loss per stage; the 8-rank pp x ep x fsdp layout shards the experts with FSDP over the remaining 2 ranks.
EP2 = ("--parallelism.expert_parallel_degree", "2")
HYBRID4 = (
    "--parallelism.context_parallel_degree",
    "4",
    "--parallelism.context_parallel_method",
    "hybrid",
    "--parallelism.context_parallel_a2a_degree",
    "2",
)
LAYOUTS += [
    _layout("moe pp2 1F1B", 2, _pp(2, "1F1B", 8, 2), model="moe_deep"),
    _layout("moe pp2 ZBVZeroBubble", 2, _pp(2, "ZBVZeroBubble", 8, 2), model="moe_deep"),
    *[
        _layout(f"{m} pp2 {s}", 2, _pp(2, s, 8, 2), model=f"{m}_deep")
        for m in ("qnext", "qnext_block")
        for s in ("1F1B", "ZBVZeroBubble")
    ],
    # the state passing inside every pipeline stage (each stage's linear layer scans over the cp group)
    _layout(
        "qnext_block cp2 pp2 1F1B",
        4,
        ("--parallelism.context_parallel_degree", "2", *_pp(2, "1F1B", 8, 2)),
        model="qnext_block_deep",
    ),
    # context parallelism by all-to-all over heads and by ring inside every stage: causal (tied), documents, window +
    # sinks, MLA
    *[
        _layout(
            f"{name} {m} cp2 pp2 1F1B",
            4,
            ("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method)
            + _pp(2, "1F1B", 8, 2),
            model=m,
        )
        for name, method in (("a2a", "alltoall"), ("ring", "ring"))
        for m in ("deep_tied", "block_deep", "gpt_oss_block_deep", "ds_deep_nomtp")
    ],
    # the split-backward (zero-bubble) schedules with each method (each backward as an input-gradient pass, through
    # the attention's backward collectives, and a later weight-gradient pass)
    *[
        _layout(
            f"{name} {m} cp2 pp2 {s}",
            4,
            ("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method)
            + _pp(2, s, 8, 2),
            model=m,
        )
        for name, method, m, s in (
            ("allgather", "allgather", "deep_tied", "ZBVZeroBubble"),
            ("allgather", "allgather", "block_deep", "InterleavedZeroBubble"),
            ("a2a", "alltoall", "gpt_oss_block_deep", "ZBVZeroBubble"),
            ("ring", "ring", "gpt_oss_block_deep", "DualPipeV"),
        )
    ],
    # hybrid (all-to-all inside pairs of cp ranks, a ring across the 2 pairs) inside every stage: cp 4 x pp 2, the
    # ring's point-to-point exchange on the cp ring group, the pipeline's on the pp group
    *[
        _layout(f"hybrid {m} cp4_a2a2 pp2 {s}", 8, HYBRID4 + _pp(2, s, 8, 2), model=m)
        for m, s in (
            ("deep_tied", "1F1B"),
            ("block_deep", "1F1B"),
            ("gpt_oss_block_deep", "1F1B"),
            ("ds_deep_nomtp", "1F1B"),
            ("deep_tied", "ZBVZeroBubble"),
        )
    ],
    _layout("moe pp2 ep2 1F1B", 4, (*EP2, *_pp(2, "1F1B", 4)), model="moe_deep"),
    _layout("moe pp2 ep2 Interleaved1F1B", 4, (*EP2, *_pp(2, "Interleaved1F1B", 4)), model="moe_deep"),
    _layout("moe pp2 ep2 padded 1F1B", 4, gate._padded(*EP2, *_pp(2, "1F1B", 4)), model="moe_deep"),
    _layout(
        "MUT moe pp2 ep2 bias update from local loads",
        4,
        (*EP2, *_pp(2, "1F1B", 4)),
        model="moe_deep",
        mutation="moe_local_loads",
    ),
    _layout(
        "MUT moe pp2 1F1B metadata inference counted as routed tokens",
        2,
        _pp(2, "1F1B", 8, 2),
        model="moe_deep",
        mutation="pp_moe_inference_counted",
    ),
    _layout("moe pp2 ep2 fsdp4 1F1B", 8, (*EP2, *_pp(2, "1F1B", 2)), model="moe_deep"),
    _layout("ds_block pp2 1F1B", 2, _pp(2, "1F1B", 8, 2), model="ds_deep"),
    _layout("ds_block pp2 ZBVZeroBubble", 2, _pp(2, "ZBVZeroBubble", 8, 2), model="ds_deep"),
    _layout("ds_block pp2 ep2 fsdp4 1F1B", 8, (*EP2, *_pp(2, "1F1B", 2)), model="ds_deep"),
    _layout("ds_block no MTP pp2 1F1B", 2, _pp(2, "1F1B", 8, 2), model="ds_deep_nomtp"),
    _layout(
        "MUT ds_block pp2 1F1B MTP tokens of another microbatch",
        2,
        _pp(2, "1F1B", 8, 2),
        model="ds_deep",
        mutation="pp_mtp_tokens_other_microbatch",
    ),
]


# Uneven splits (5 blocks; titanlike.layout.split_module_names, torchtitan's arithmetic): 1F1B [emb, 0-2] [3-4, head];
# ZBV's V [emb, 0-1] [2] [3] [4, head]; with the embedding and the head weighing a block each, 4 virtual stages
# [emb, 0] [1-2] [3-4] [head alone] (Interleaved1F1B; InterleavedZeroBubble under FSDP).
ENDS_1_1 = (
    "--parallelism.pipeline_parallel_first_stage_less_layers",
    "1",
    "--parallelism.pipeline_parallel_last_stage_less_layers",
    "1",
)
LAYOUTS += [
    _layout("pp2 1F1B uneven 5 layers", 2, _pp(2, "1F1B", 8, 2), model="five"),
    _layout("pp2 ZBVZeroBubble uneven 5 layers", 2, _pp(2, "ZBVZeroBubble", 8, 2), model="five"),
    _layout("pp2 Interleaved1F1B uneven 5 layers 1+1", 2, _pp(2, "Interleaved1F1B", 8, 2, *ENDS_1_1), model="five"),
    _layout(
        "pp2 fsdp2 InterleavedZeroBubble uneven 5 layers 1+1",
        4,
        _pp(2, "InterleavedZeroBubble", 4, 1, *ENDS_1_1),
        model="five",
    ),
    # DeepSeek-V3 (4 blocks, MTP) under DualPipeV with the head weighing a block: [emb, 0-1] [2] [3] [head + MTP alone]
    _layout(
        "ds_block pp2 DualPipeV uneven head and MTP alone",
        2,
        _pp(2, "DualPipeV", 8, 2, "--parallelism.pipeline_parallel_last_stage_less_layers", "1"),
        model="ds_deep",
    ),
    _layout(
        "MUT pp2 1F1B uneven split runs a boundary block twice",
        2,
        _pp(2, "1F1B", 8, 2),
        model="five",
        mutation="pp_split_block_twice",
    ),
]


# ---------------------------------------------------------------------------------------------- mutations
@contextlib.contextmanager
def _split_block_twice():
    """The split off by one at the first stage boundary: the second stage's first block also on the first stage
    (its own copy), so the residual stream goes through it twice."""
    import titanlike.parallel.pipeline.api as api

    real = api.stage_module_names  # apply_pp reads the split through this name

    def off_by_one(cfg, args):
        stages = real(cfg, args)
        block = next(n for n in stages[1] if n.startswith("layers."))
        return [[*stages[0], block], *stages[1:]]

    with patched(api, "stage_module_names", off_by_one):
        yield


@contextlib.contextmanager
def _tied_not_summed():
    """The first and last stage keep their own gradient of the tied weight: the copies drift apart."""
    from titanlike.parallel.pipeline import PipelineParallel

    with patched(PipelineParallel, "finalize_grads", lambda self: None):
        yield


@contextlib.contextmanager
def _loss_over_microbatches():
    """The schedule keeps torch's default ``scale_grads=True``: gradients divided by the number of microbatches
    on top of the loss's own global-token scaling."""
    import titanlike.parallel.pipeline.runtime as runtime

    def default_scaling(cls):
        return lambda *a, **kw: cls(*a, **{**kw, "scale_grads": True})

    real = runtime.schedule_class
    with patched(runtime, "schedule_class", lambda name: default_scaling(real(name))):
        yield


@contextlib.contextmanager
def _norm_not_reduced():
    """Each stage clips with the norm of its own parameters only."""
    import titanlike.parallel.clip as clip

    with patched(clip, "reduce_across_stages", lambda norm_sq, pp_group: norm_sq):
        yield


@contextlib.contextmanager
def _tied_norm_twice():
    """Both copies of the tied weight enter the gradient norm."""
    import titanlike.parallel.clip as clip

    original = clip.clip_grad_norm_  # finalize_grads_and_clip_ looks it up in the module at call time

    def counting_all(params, max_norm, pp_group=None, *, norm_parameters=None, foreach=None):
        return original(params, max_norm, pp_group, foreach=foreach)

    with patched(clip, "clip_grad_norm_", counting_all):
        yield


@contextlib.contextmanager
def _fsdp_reshard_after_forward():
    """FSDP frees the gathered parameters after each forward (what ``fsdp_reshard_after_forward = "always"``, which
    the configuration refuses with the zero-bubble schedules, would do)."""
    import titanlike.parallel.parallelize as parallelize

    original = parallelize.apply_fsdp  # parallelize_model applies FSDP through this name

    def always(model, dp_mesh, **kw):
        return original(model, dp_mesh, **{**kw, "reshard_after_forward": "always"})

    with patched(parallelize, "apply_fsdp", always):
        yield


@contextlib.contextmanager
def _starts_other_microbatch():
    """The schedule's keyword tensors (the document starts) split by microbatch, then handed to the wrong
    microbatch (rotated by one): each microbatch runs with another's documents."""
    import torch.distributed.pipelining.schedules as schedules

    original = schedules.split_args_kwargs_into_chunks

    def rotated(*args, **kwargs):
        args_split, kwargs_split = original(*args, **kwargs)
        return args_split, kwargs_split[1:] + kwargs_split[:1]

    with patched(schedules, "split_args_kwargs_into_chunks", rotated):
        yield


@contextlib.contextmanager
def _mtp_tokens_other_microbatch():
    """The last stage's MTP depths get another microbatch's token ids (the schedule's ``token_ids`` keyword split by
    microbatch, then rotated by one; the document starts and targets stay): each depth embeds the wrong tokens
    ahead. The logged loss is the next-token one, exact; the depths' gradients break."""
    import torch.distributed.pipelining.schedules as schedules

    original = schedules.split_args_kwargs_into_chunks

    def rotated(*args, **kwargs):
        args_split, kwargs_split = original(*args, **kwargs)
        ids = [kw.get("token_ids") for kw in kwargs_split]
        if ids and ids[0] is not None:
            kwargs_split = [{**kw, "token_ids": t} for kw, t in zip(kwargs_split, ids[1:] + ids[:1])]
        return args_split, kwargs_split

    with patched(schedules, "split_args_kwargs_into_chunks", rotated):
        yield


@contextlib.contextmanager
def _moe_inference_counted():
    """torch's first-step metadata inference forward (empty tensors) counted by the MoE blocks like a training
    forward: extra routed tokens in the loads, a wrong bias update."""
    import titanlike.parallel.pipeline.runtime as runtime

    with patched(runtime, "stats_paused", contextlib.nullcontext):
        yield


gate.MUTATIONS.update(
    {
        "pp_split_block_twice": _split_block_twice,
        "pp_moe_inference_counted": _moe_inference_counted,
        "pp_mtp_tokens_other_microbatch": _mtp_tokens_other_microbatch,
        "pp_starts_other_microbatch": _starts_other_microbatch,
        "pp_tied_not_summed": _tied_not_summed,
        "pp_loss_over_microbatches": _loss_over_microbatches,
        "pp_norm_not_reduced": _norm_not_reduced,
        "pp_tied_norm_twice": _tied_norm_twice,
        "pp_fsdp_reshard_after_forward": _fsdp_reshard_after_forward,
    }
)


# ---------------------------------------------------------------------------------------------- builder, eval
EVAL: dict[str, list[float]] = {}  # layout name -> [eval diff before training, after the last step]
_BUILT: dict = {}


def _dp_slice(dims, t: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's rows, and this cp rank's two chunks of each (the data loader's cut)."""
    rows = GLOBAL_BATCH // dims.dp
    r = dims.get_mesh("dp").get_local_rank()
    return gate.cp_slicer(dims)(t[r * rows : (r + 1) * rows])


def _eval_diff(pp, dims, reference: nn.Module, cfg) -> float:
    """|sum CE of the pipeline over the global eval batch - one device's|, this rank's view."""
    from titanlike.loss import cross_entropy_loss

    inputs, labels, *starts = gate.step_batch(cfg, STEPS + 1)
    mine = [_dp_slice(dims, t) for t in starts]
    total = pp.eval_loss(_dp_slice(dims, inputs), _dp_slice(dims, labels), *mine)
    group = gate.loss_group_for_gate(dims)
    if group is not None:
        dist.all_reduce(total, group=group)
    kwargs = {"document_starts": starts[0]} if starts else {}
    mode = reference.training
    reference.eval()  # as the pipeline's eval (an MoE block counts loads and its aux loss in training only)
    with torch.no_grad():
        expected = cross_entropy_loss(reference(inputs, **kwargs), labels, reduction="sum")
    reference.train(mode)
    return abs(total.item() - expected.item())


def build_pp(layout: Layout, cfg, ctx, initial) -> Built:
    """``build_parallel_model`` (``apply_pp``) on the full model, the trainer's own builder; the validation loss is
    checked once before training."""
    from titanlike.parallel import build_parallel_model

    dims = ctx.dims(cfg)  # built once per shape: no new process groups per layout
    if layout.model in gate.CUSTOM_MODELS:  # a model changed after construction (extra ties): the materialised path
        built = build_parallel_model(initial, cfg, dims, torch.device("cpu"))
    else:  # the trainer's fresh start: stages built and parallelized on meta, each rank generating only its shards
        built = build_parallel_model(
            gate.build_model(cfg, device="meta"), cfg, dims, torch.device("cpu"), init_seed=gate.INIT_SEED
        )
    pp = built.pp
    EVAL[layout.name] = [_eval_diff(pp, dims, initial, cfg)]
    _BUILT.update(pp=pp, dims=dims)
    n_micro = cfg.training.global_batch_size // (cfg.training.local_batch_size * dims.dp)

    def micro_batches(*batch):
        return gate.cut_batch(batch, partial(_dp_slice, dims), n_micro)

    return Built(
        model_parts=built.model_parts,
        optimizer=build_optimizer(built.model_parts, cfg),
        loss=built.loss,
        clip_fn=built.clip_fn,
        micro_batches=micro_batches,
        step_kwargs={
            "dp_group": gate.loss_group_for_gate(dims),
            "pp_schedule": pp.schedule,
            "pp_group": pp.pp_group,
            "has_last_stage": pp.has_last_stage,
            "moe": built.moe,
        },
    )


gate.BUILDERS["pp"] = build_pp


def build_user_pp(layout: Layout, cfg, ctx, initial) -> Built:
    """A user's module through ``pipeline_module``: the user gives the split (module FQNs per stage), a TP plan
    per stage and a loss; no torch.distributed.pipelining call and no weight reordering on the user's side."""
    from nanogpt import tp_plan

    from titanlike.layout import schedule_facts
    from titanlike.loss import cross_entropy_loss
    from titanlike.parallel import apply_tp
    from titanlike.parallel.pipeline import pipeline_module

    dims = ctx.dims(cfg)
    mesh = dims.world_mesh  # the user's way: submeshes sliced from the world mesh
    schedule = cfg.parallelism.pipeline_parallel_schedule
    n_micro = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size

    def parallelize(module, is_first, is_last):
        return apply_tp(module, mesh["tp"], tp_plan(module)) if dims.tp_enabled else module

    split = NANO_SPLIT_V if schedule_facts(schedule).v_placement else NANO_SPLIT
    pp = pipeline_module(
        copy.deepcopy(initial),
        mesh["pp"],
        split,
        loss_fn=lambda out, labels: cross_entropy_loss(out, labels, reduction="sum"),
        n_microbatches=n_micro,
        schedule=schedule,
        parallelize_stage=parallelize,
    )
    n_acc = cfg.training.global_batch_size // (cfg.training.local_batch_size * dims.dp)

    def micro_batches(*batch):
        return gate.cut_batch(batch, partial(_dp_slice, dims), n_acc)

    return Built(
        model_parts=pp.model_parts,
        optimizer=build_optimizer(pp.model_parts, cfg),
        loss=pp.loss,
        clip_fn=pp.finalize_grads_and_clip_,
        micro_batches=micro_batches,
        step_kwargs={
            "dp_group": dims.get_mesh("dp").get_group() if dims.dp_enabled else None,
            "pp_schedule": pp.schedule,
            "pp_group": pp.pp_group,
            "has_last_stage": pp.has_last_stage,
        },
    )


gate.BUILDERS["user_pp"] = build_user_pp


def run(layout: Layout, ctx) -> dict:
    result = gate.run_layout(layout, ctx)
    if layout.kind == "user_pp":  # no titanlike eval hook for a user's module: training is what is compared
        result["eval"] = 0.0
        return result
    t0 = time.perf_counter()
    cfg = gate.config(layout, ctx.world_size)
    _, records = ctx.reference(layout, cfg)
    final = gate.CUSTOM_MODELS[layout.model]() if layout.model in gate.CUSTOM_MODELS else gate.build_model(cfg)
    last = records[result["steps"] - 1]  # a mutation may have stopped before STEPS
    final.load_state_dict({**last.weights, **last.biases})
    EVAL[layout.name].append(_eval_diff(_BUILT["pp"], _BUILT["dims"], final, cfg))
    diffs = torch.tensor([v if v == v else math.inf for v in EVAL[layout.name]], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    result["eval"] = max(diffs.tolist())
    result["ok"] = result["ok"] and result["eval"] <= TOL
    result["seconds"] = round(result["seconds"] + time.perf_counter() - t0, 2)
    _BUILT.clear()
    return result


def gate_main(rank: int, world_size: int, out: str, only: list[str] | None) -> None:
    # full_tensor() of FSDP x ep expert weights warns that it gathers one mesh dim at a time: expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ctx = gate.Context(world_size)
    results = {}
    for layout in LAYOUTS:
        if layout.world_size != world_size or (only and layout.name not in only):
            continue
        results[layout.name] = r = run(layout, ctx)
        if rank == 0:
            print(
                f"[pp gate ws={world_size}] {layout.name:42s} ok={r['ok']!s:5} loss {r['loss']:.1e} grad_norm "
                f"{r['grad_norm']:.1e} grads {r['grads']:.1e} weights {r['weights']:.1e} eval {r['eval']:.1e} "
                f"({r['seconds']} s)",
                flush=True,
            )
    if rank == 0:
        Path(out).write_text(json.dumps({"world_size": world_size, "tolerance": TOL, "layouts": results}, indent=1))


def main(argv: list[str] | None = None) -> int:
    return gate.main(argv, entry=gate_main, layouts=LAYOUTS)


if __name__ == "__main__":
    sys.exit(main())
