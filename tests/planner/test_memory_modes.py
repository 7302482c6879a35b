"""The planner's price of the memory modes: ZeRO-1 (parallelism.distributed_optimizer), FSDP's CPU offload
(training.enable_cpu_offload) and activation offload (activation_checkpoint.offload), against the plain layouts."""

from __future__ import annotations

import pytest

from titanlike.config import load_config, model_args_from_config
from titanlike.planner.cost import messages
from titanlike.planner.layout import Layout
from titanlike.planner.memory import rank_host_memory, rank_memory

BASE = [
    "--job.config_file",
    "configs/debug_model.toml",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "4",
]
DDP2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]


def _plan(*extra: str):
    cfg = load_config([*BASE, *extra], world_size=2)
    args = model_args_from_config(cfg, vocab_size=2048)
    layout = Layout.from_config(cfg, 2, args, gpus_per_node=2)
    return layout, args, {it.name: it.bytes for it in rank_memory(layout, args)}


def test_zero1_holds_half_the_optimizer_state_and_all_gathers_the_parameters_once():
    lo, args, zero1 = _plan(*DDP2, "--parallelism.distributed_optimizer", "true")
    _, _, ddp = _plan(*DDP2)
    assert zero1["parameters"] == ddp["parameters"] and zero1["gradients"] == ddp["gradients"]
    assert zero1["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=1e-3)
    n = sum(p.numel() for p in _meta_params(args))
    step = [m for m in messages(lo, args) if m.what == "ZeRO-1 AdamW update"]
    assert [(m.op, m.dim, m.count, m.nbytes) for m in step] == [("all_gather", "dp_replicate", 1, n * 4)]


def test_cpu_offload_moves_the_fsdp_state_to_the_host():
    lo, args, off = _plan(*FSDP2, "--training.enable_cpu_offload", "true")
    _, _, fsdp = _plan(*FSDP2)
    host = {it.name: it.bytes for it in rank_host_memory(lo, args)}
    for name in ("parameters", "gradients", "optimizer"):
        assert off[name] == 0 and host[name] == fsdp[name] > 0, name
    assert off["activations"] == fsdp["activations"]


def test_activation_offload_keeps_two_blocks_on_the_device():
    """The backward runs one block while the previous one is brought back."""
    lo, args, off = _plan(*FSDP2, "--activation_checkpoint.offload", "true")
    _, _, plain = _plan(*FSDP2)
    host = {it.name: it.bytes for it in rank_host_memory(lo, args)}["offloaded activations"]
    per_block = host / args.n_layers
    assert off["activations"] == pytest.approx(plain["activations"] - host + 2 * per_block)


def _meta_params(args):
    import torch

    from titanlike.models import get_spec

    with torch.device("meta"):
        return list(get_spec("llama3").build(args).parameters())
