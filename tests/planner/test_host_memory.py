"""The host-memory refusal of a CPU run: only when this node's ranks' shards (the planner's per-rank state) do not
fit the host, never for the size of the full model; one line naming the planner's number and the fix, exit 2, before
any process group. The host's size is faked (``host_memory_bytes`` monkeypatched)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from titanlike.config import model_args_from_config, parse_config
from titanlike.data import asset_path, build_tokenizer
from titanlike.planner import host
from titanlike.planner.layout import Layout
from titanlike.planner.memory import rank_state_memory
from titanlike.planner.plan import fmt_bytes
from titanlike.training import trainer as trainer_mod
from titanlike.training.trainer import main

# 32 blocks of dim 128 (6.4M parameters): at 8 FSDP ranks the state of the whole node (params + grads + AdamW shards
# and each rank's gathered groups) is 0.69 x one float32 copy of the model per rank, which the old check required.
ARGV = [
    "--model.flavor",
    "tiny",
    "--model.n_layers",
    "32",
    "--model.dim",
    "128",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "1",
    "--data.path",
    str(asset_path("corpus", "tinyshakespeare.txt")),
    "--validation.enable",
    "false",
    "--metrics.enable_tensorboard",
    "false",
]
WORLD = 8


class ReachedProcessGroup(Exception):
    pass


def _model(argv):
    """The config and the model's shape as the trainer sees them (the vocabulary comes from the tokenizer)."""
    cfg = parse_config(argv)
    return cfg, model_args_from_config(cfg, build_tokenizer(cfg.model.tokenizer).vocab_size)


def _planned(argv, ranks=range(WORLD), world=WORLD, only=None):
    cfg, args = _model(argv)
    layout = Layout.from_config(cfg, world, args, len(ranks))
    per_rank = {
        r: sum(it.bytes for it in rank_state_memory(layout, args, r) if only is None or it.name in only) for r in ranks
    }
    return args, per_rank


@pytest.fixture
def eight_local_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def reached(*a, **k):
        raise ReachedProcessGroup

    monkeypatch.setattr(trainer_mod.dist, "init_process_group", reached)


def test_refused_only_when_the_shards_do_not_fit(eight_local_ranks, monkeypatch, capsys):
    args, per_rank = _planned(ARGV)
    total = sum(per_rank.values())
    old_need = args.num_params() * 4 * WORLD  # the old check: one float32 copy of the model per local rank
    # Just enough host for the shards: accepted (the trainer goes on to start the process group), although the old
    # check (full model x ranks > 0.8 x host) refused this start.
    fits = int(total / host.HOST_FRACTION) + 1
    assert old_need > 0.8 * fits
    monkeypatch.setattr(host, "host_memory_bytes", lambda: fits)
    with pytest.raises(ReachedProcessGroup):
        main(ARGV)
    # One byte less: refused with one line naming the planner's per-rank number, the node's total and the fix.
    monkeypatch.setattr(host, "host_memory_bytes", lambda: fits - 2)
    capsys.readouterr()
    assert main(ARGV) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    worst = max(per_rank, key=per_rank.get)
    assert err[0].startswith(
        f"error: host memory: the 8 ranks on this host need {fmt_bytes(total)} of state, more "
        f"than 80% of the {fmt_bytes(fits - 2)} of host memory (rank {worst}: "
        f"{fmt_bytes(per_rank[worst])}, planner: parameters "
    ), err
    assert "start fewer ranks per node (torchrun --nproc_per_node)" in err[0]
    assert not dist.is_initialized()


def test_every_node_is_checked_cuda_is_not_and_a_seed_run_counts_its_weights():
    cfg, args = _model(ARGV)
    _, per_rank = _planned(ARGV)
    assert host.local_world_size(WORLD, {"LOCAL_WORLD_SIZE": "4"}) == 4 and host.local_world_size(1, {}) == 1
    # Two nodes of 4 ranks: every rank judges both (the same answer on every rank, whichever node is short).
    node = max(sum(per_rank[r] for r in range(first, first + 4)) for first in (0, 4))
    assert (
        host.host_memory_problem(cfg, WORLD, args, local_ranks=4, host_bytes=int(node / host.HOST_FRACTION) + 1) is None
    )
    short = host.host_memory_problem(cfg, WORLD, args, local_ranks=4, host_bytes=int(node / host.HOST_FRACTION) - 1)
    assert f"the 4 ranks on node 0 (ranks 0-3, a host like this one) need {fmt_bytes(node)} of state" in short, short
    # No host refusal on CUDA: the host holds one parameter shard at a time there.
    assert host.host_memory_problem(cfg, WORLD, args, local_ranks=8, host_bytes=1, device_type="cuda") is None
    # A seed-checkpoint run holds its parameter shards only.
    seed = parse_config(ARGV + ["--checkpoint.create_seed_checkpoint"])
    _, params = _planned(ARGV, only=("parameters",))
    need = sum(params.values())
    assert need < sum(per_rank.values()) / 4
    assert (
        host.host_memory_problem(seed, WORLD, args, local_ranks=8, host_bytes=int(need / host.HOST_FRACTION) + 1)
        is None
    )
    assert f"on this host need {fmt_bytes(need)} of weights" in host.host_memory_problem(
        seed, WORLD, args, local_ranks=8, host_bytes=int(need / host.HOST_FRACTION) - 1
    )
    # One process: the whole model is its shard.
    one = host.host_memory_problem(cfg, 1, args, local_ranks=1, host_bytes=1)
    assert one.startswith("host memory: the one rank on this host needs "), one
