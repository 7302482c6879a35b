"""The planner prices Qwen3-Next's cp messages by layer kind: the full-attention blocks' K/V gathers grow with
seq_len, the Gated DeltaNet blocks' state maps and conv halos do not (titanlike.parallel.state_passing)."""

from __future__ import annotations

from titanlike.config import model_args_from_config, parse_config
from titanlike.parallel.state_passing import state_message_numel
from titanlike.planner import messages
from titanlike.planner.layout import Layout

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
