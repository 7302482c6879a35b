"""The planner prices Qwen3-Next's cp messages by layer kind: the full-attention blocks' K/V gathers grow with
seq_len, the Gated DeltaNet blocks' state maps and conv halos do not (titanlike.parallel.state_passing); a Gated
DeltaNet block's activations equal the dry run's probe."""

from __future__ import annotations

import pytest

from titanlike.config import model_args_from_config, parse_config
from titanlike.parallel.state_passing import state_message_numel
from titanlike.planner import block_activation_bytes, dry_run, messages
from titanlike.planner.layout import Layout
from titanlike.planner.memory import moe_layers

BASE = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel", "--model.max_seq_len", "8192"]


def _cp_messages(seq_len: int, *more: str):
    argv = [*BASE, "--parallelism.context_parallel_degree", "2", "--training.seq_len", str(seq_len), *more]
    cfg = parse_config(argv)
    args = model_args_from_config(cfg).replace(vocab_size=2048)
    layout = Layout.from_config(cfg, 2, args, 8)
    return {m.what: m for m in messages(layout, args) if m.dim == "cp"}, args, layout


def test_state_messages_are_independent_of_seq_len_and_kv_gathers_are_not():
    short, args, lo = _cp_messages(256)
    long, _, _ = _cp_messages(4096)
    state = "linear-attention state maps of every linear block"
    per_rank = state_message_numel(lo.microbatch_size, args.linear_v_heads, args.linear_k_head_dim, 32)
    assert short[state].nbytes == long[state].nbytes == 2 * per_rank * 4  # cp 2 ranks' maps, float32
    assert short[state].count == args.n_layers - args.n_full_layers  # one per linear block (and microbatch)
    halo = "short-conv halos of every linear block"
    assert short[halo].nbytes == long[halo].nbytes
    kv = "K and V of every block"
    assert long[kv].nbytes == 16 * short[kv].nbytes and short[kv].count == 2 * args.n_full_layers


def test_full_ac_gathers_the_state_maps_again():
    msgs, args, _ = _cp_messages(256, "--activation_checkpoint.mode", "full")
    assert msgs["recomputed linear-attention state maps (full AC)"].count == args.n_layers - args.n_full_layers


PROBE = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel", "--training.seq_len", "128"]
TP_EP = [
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.enable_sequence_parallel",
    "--parallelism.expert_parallel_degree",
    "2",
]
PROBE_CASES = {
    "one_device_bf16": (1, ["--training.dtype", "bfloat16"]),
    "one_device_fp32": (1, ["--training.dtype", "float32"]),
    "tp2_sp_ep2_bf16": (2, [*TP_EP, "--training.dtype", "bfloat16"]),
    # 60 tokens: the chunked rule pads the last chunk of 8
    "padded_chunk_fp32": (1, ["--training.dtype", "float32", "--training.seq_len", "60"]),
    # state passing (rank 0): two widened pieces, the scan of the gathered maps (before: 1.00 MiB against 3.40)
    "cp2_bf16": (2, ["--training.dtype", "bfloat16", "--parallelism.context_parallel_degree", "2"]),
    "cp4_fp32": (4, ["--training.dtype", "float32", "--parallelism.context_parallel_degree", "4"]),
    "cp2_tp2_sp_ep2_bf16": (4, [*TP_EP, "--training.dtype", "bfloat16", "--parallelism.context_parallel_degree", "2"]),
    "op_ac_bf16": (1, ["--training.dtype", "bfloat16", "--activation_checkpoint.mode", "selective"]),
    "tp2_sp_ep2_op_ac_bf16": (2, [*TP_EP, "--training.dtype", "bfloat16", "--activation_checkpoint.mode", "selective"]),
    "cp2_op_ac_fp32": (
        2,
        [
            "--training.dtype",
            "float32",
            "--parallelism.context_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ),
    # pieces of 12 tokens in chunks of 8: padded
    "cp2_padded_bf16": (
        2,
        ["--training.dtype", "bfloat16", "--parallelism.context_parallel_degree", "2", "--training.seq_len", "48"],
    ),
}


@pytest.mark.parametrize("name", list(PROBE_CASES))
def test_gated_deltanet_block_activations_equal_the_probe(name):
    """The Gated DeltaNet layer's own term (``ModelSpec.attention_activations``: titanlike.models.qwen3_next
    .activations), the zero-centred norms' float32 outputs and the shared expert's gate equal the dry run's probe of
    layer 0 (Gated DeltaNet + MoE) exactly, as for Llama. Before them: 1.82 MiB analytic against the probe's 5.07
    (one device bf16, 2 x 128 tokens)."""
    world, extra = PROBE_CASES[name]
    cfg = parse_config([*PROBE, "--training.local_batch_size", "2", *extra])
    args = model_args_from_config(cfg, 2048)
    layout = Layout.from_config(cfg, world, args, gpus_per_node=8)
    d = dry_run(cfg, layout, args)
    assert d.probe_layer == 0 and args.layer_type(0) == "linear_attention"
    moe = moe_layers(args, layout.stages[0]).get(0)
    tokens = layout.microbatch_size * layout.local_seq_len
    mode = layout.checkpointed(0)
    assert mode == ("op" if "op_ac" in name else "none")
    analytic = block_activation_bytes(layout, args, tokens, mode, moe, probe=True, layer_id=0)
    assert d.block_activation_bytes == analytic, (name, d.block_activation_bytes, analytic)
