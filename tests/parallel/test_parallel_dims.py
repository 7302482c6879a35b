"""ParallelDims, the rank grid and describe_layout (pure Python), and the layout errors of the configuration."""

import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import worker_env

from titanlike.config import ConfigError, load_config
from titanlike.parallel import ParallelDims, describe_layout, rank_groups, rank_of

REPO = Path(__file__).resolve().parents[2]


def test_dp_shard_is_inferred_and_the_product_must_be_the_world_size():
    assert ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=2, world_size=16).dp_shard == 2
    d = ParallelDims(1, -1, 1, 1, 1, 8)
    assert (d.dp_shard, d.dp, d.fsdp_enabled, d.tp_enabled, d.shape) == (8, 8, True, False, (1, 1, 8, 1, 1))
    with pytest.raises(ConfigError, match="world size 8 is not divisible by tp 3"):
        ParallelDims(1, -1, 1, 3, 1, 8)
    with pytest.raises(ConfigError, match="= 12 != world size 8"):
        ParallelDims(1, 3, 1, 2, 2, 8)
    with pytest.raises(ConfigError, match="tensor_parallel_degree: 0 must be >= 1"):
        ParallelDims(1, -1, 1, 0, 1, 8)


def test_tp_is_innermost_and_pp_outermost():
    d = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=2, world_size=16)
    assert rank_groups(d, "tp")[:2] == [[0, 1], [2, 3]]
    assert rank_groups(d, "dp_shard")[:2] == [[0, 2], [1, 3]]
    assert rank_groups(d, "dp_replicate")[:2] == [[0, 4], [1, 5]]
    assert rank_groups(d, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert rank_groups(d, "pp") == [[r, r + 8] for r in range(8)]
    assert rank_groups(d, "dp_shard_cp") == rank_groups(d, "dp_shard")
    assert rank_of(d, {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}) == 13
    for name in ("tp", "dp", "pp", "dp_shard_cp"):  # every dim's groups partition the ranks
        assert sorted(r for g in rank_groups(d, name) for r in g) == list(range(16))
    with pytest.raises(ValueError, match="unknown mesh dims"):
        rank_groups(d, "ep")


@pytest.mark.parametrize("rank", [0, 13])
def test_the_device_mesh_matches_the_pure_python_grid(rank):
    """build_mesh / get_mesh on a fake 16-rank process group give the groups rank_groups predicts."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
    try:
        d = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=2, world_size=16)
        mesh = d.build_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert d.build_mesh("cpu") is mesh  # built once: the ParallelDims keeps its meshes
        for name in ("tp", "pp", "dp", "dp_replicate", "dp_shard_cp"):
            mine = next(g for g in rank_groups(d, name) if rank in g)
            assert d.get_mesh(name).mesh.flatten().tolist() == mine, name
        hsdp = d.get_mesh(("dp_replicate", "dp_shard_cp"))
        assert hsdp.ndim == 2 and sorted(hsdp.mesh.flatten().tolist()) == next(
            g for g in rank_groups(d, "dp") if rank in g
        )
        with pytest.raises(ValueError, match="must be one of"):
            d.get_mesh(("dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_describe_layout_lists_groups_and_warns_for_tp_across_nodes():
    d = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=4, pp=1, world_size=8)
    text = describe_layout(d, gpus_per_node=8)
    assert "pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 4 = world size 8" in text
    assert "tp groups of 4: [0,1,2,3] [4,5,6,7]" in text
    assert "dp_shard (fsdp) groups of 2: [0,4] [1,5] [2,6] [3,7]" in text
    assert "WARNING" not in text
    warned = describe_layout(d, gpus_per_node=2).splitlines()
    assert [line for line in warned if line.startswith("WARNING")] == [line for line in warned if "spans nodes" in line]
    assert sum(line.startswith("WARNING: tp group [0,1,2,3] spans nodes [0, 1]") for line in warned) == 1
    assert sum(line.startswith("WARNING") for line in warned) == 2
    pp = describe_layout(ParallelDims(1, -1, 1, 2, 2, 4), gpus_per_node=2)
    assert "pp groups of 2: [0,2] [1,3]" in pp and "WARNING" not in pp


def test_describe_layout_takes_gpus_per_node_from_local_world_size(monkeypatch):
    d = ParallelDims(1, -1, 1, 4, 1, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert describe_layout(d).count("WARNING") == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert "WARNING" not in describe_layout(d)


TINY = ["--model.flavor", "tiny", "--training.seq_len", "16", "--training.local_batch_size", "4"]


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--parallelism.tensor_parallel_degree", "3"], 4, "world size 4 is not divisible by tp 3"),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "3"],
            4,
            "!= world size 4",
        ),
        (["--parallelism.tensor_parallel_degree", "8"], 8, "does not divide n_heads 4"),
        (["--parallelism.tensor_parallel_degree", "4"], 4, "does not divide n_kv_heads 2"),
        (
            [
                "--model.flavor",
                "gpt2_small",
                "--model.vocab_multiple",
                "1",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
            2,
            "does not divide the vocabulary 50257; set model.vocab_multiple",
        ),
        (["--parallelism.enable_sequence_parallel"], 2, "enable_sequence_parallel needs tensor_parallel_degree > 1"),
        (
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_sequence_parallel",
                "--training.seq_len",
                "15",
            ],
            2,
            "seq_len 15 is not divisible by tensor_parallel_degree 2",
        ),
        (
            ["--training.global_batch_size", "6"],
            2,
            "global_batch_size 6 is not divisible by local_batch_size 4 x data-parallel degree 2",
        ),
    ],
)
def test_bad_layouts_are_config_errors_naming_the_fix(argv, world, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY + argv, world_size=world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_train_py_exits_2_with_one_line_on_a_bad_layout():
    env = worker_env(WORLD_SIZE="4")
    proc = subprocess.run(
        [sys.executable, "train.py", *TINY, "--parallelism.tensor_parallel_degree", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not divisible by tp 3" in lines[0], proc.stderr


def test_expert_parallel_borrows_consecutive_ranks_of_dp_shard_x_cp():
    from titanlike.layout import expert_groups

    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=1, pp=1, world_size=8, ep=2)
    assert dims.dp_shard_mod_ep == 2 and dims.ep_enabled
    # ep innermost of (dp_shard, cp) within each replica: the cp pairs here
    assert expert_groups(dims) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "ep groups of 2 (experts sharded; FSDP of the experts over the other 2): [0,1] [2,3]" in describe_layout(
        dims
    )
    with pytest.raises(ConfigError, match="expert_parallel_degree 3 does not divide dp_shard 4 x cp 1 = 4"):
        ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, world_size=4, ep=3)


def test_expert_parallel_borrows_the_tp_ranks_under_tp():
    """tp 2 (with sequence parallelism each tp rank holds other tokens): ep borrows from dp_shard x cp x tp, tp
    innermost, so an ep group of 2 is a tp group and one of 4 spans two dp_shard ranks' tp groups."""
    from titanlike.layout import expert_groups

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4, ep=2)
    assert dims.ep_tp == 2 and dims.dp_shard_mod_ep == 2
    assert expert_groups(dims) == [[0, 1], [2, 3]]  # the tp pairs
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4, ep=4)
    assert dims.dp_shard_mod_ep == 1 and expert_groups(dims) == [[0, 1, 2, 3]]
    assert ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4).ep_tp == 1  # no ep: no borrowing
    with pytest.raises(ConfigError, match="expert_parallel_degree 3 does not divide dp_shard 2 x cp 1 x tp 2 = 4"):
        ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4, ep=3)
