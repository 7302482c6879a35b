"""Bad ``[fault_tolerance]`` input: one line naming the fix, exit code 2, before any process group starts
(titanlike/training/fault_tolerance.py: config_problems, check_runtime)."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import torch.distributed as dist

from titanlike.config import load_config
from titanlike.errors import ConfigError
from titanlike.training import fault_tolerance
from titanlike.training.trainer import main

BASE = ["--model.flavor", "tiny", "--training.steps", "1", "--training.seq_len", "16", "--validation.enable", "false"]


def _port_nobody_listens_on() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, tmp_path, *args: str) -> tuple[int, str]:
    code = main([*BASE, "--job.dump_folder", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert not dist.is_initialized()
    return code, err


def problems(*args: str, world_size: int = 1) -> list[str]:
    return fault_tolerance.config_problems(load_config([*BASE, *args], world_size=world_size))


def test_each_problem_is_one_line_and_all_are_reported_at_once(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    on = ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510"]
    assert problems(*on, "--fault_tolerance.group_size", "2") == []
    (p,) = problems(*on)
    assert p.startswith("fault_tolerance.group_size: set the number of replica groups")
    (p,) = problems(*on, "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2")
    assert "0 .. 1" in p and p.startswith("fault_tolerance.replica_id: 2 is not a group")
    (p,) = problems(*on, "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "3")
    assert p.startswith("fault_tolerance.min_replica_size: 3 groups can never take part") and "at most 2" in p
    (p,) = problems(
        *on, "--fault_tolerance.group_size", "2", "--parallelism.data_parallel_replicate_degree", "2", world_size=2
    )
    assert "the replica groups are the replicate dimension; set it to 1" in p
    (p,) = problems(*on, "--fault_tolerance.group_size", "2", "--optimizer.name", "Muon")
    assert p.startswith("optimizer.name: Muon with fault_tolerance.enable")
    (p,) = problems("--fault_tolerance.enable", "--fault_tolerance.group_size", "2")
    assert "TORCHFT_LIGHTHOUSE" in p and "scripts/ft_lighthouse.sh" in p
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")  # torchtitan's way of giving it
    assert problems("--fault_tolerance.enable", "--fault_tolerance.group_size", "2") == []
    (p,) = problems(*on[:-1], "nohost:", "--fault_tolerance.group_size", "2")
    assert "is not an address like http://host:29510" in p
    monkeypatch.delenv("MASTER_ADDR")
    (p,) = problems(*on, "--fault_tolerance.group_size", "2")
    assert "under torchrun" in p
    # keys set without enable would be ignored: refused, all named
    (p,) = problems("--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1")
    assert "fault_tolerance.replica_id, fault_tolerance.group_size set while fault_tolerance.enable is false" in p
    assert len(problems("--fault_tolerance.enable", "--fault_tolerance.replica_id", "3")) == 2


def test_the_trainer_exits_2_with_every_problem_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code, err = run(capsys, tmp_path, "--fault_tolerance.enable", "--fault_tolerance.min_replica_size", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "fault_tolerance.group_size: set" in err and "fault_tolerance.lighthouse: no lighthouse address" in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_torchft_not_installed_names_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    port = _port_nobody_listens_on()
    args = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    code, err = run(capsys, tmp_path, *args, "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "needs torchft, which is not installed" in err and "pip install 'titanlike[ft]'" in err


def test_an_unreachable_lighthouse_is_one_line_bounded_by_the_connect_timeout(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torchft", reason="the optional extra titanlike[ft] (torchft) is not installed")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    args = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    port = _port_nobody_listens_on()
    code, err = run(capsys, tmp_path, *args, "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}")
    assert code == 2 and "cannot reach the lighthouse at" in err and "Connection refused" in err, err
    # an address that never answers (a TEST-NET-1 host, RFC 5737): refused after connect_timeout_seconds at most
    cfg = load_config([*BASE, *args, "--fault_tolerance.lighthouse", "http://192.0.2.1:29510"], world_size=1)
    cfg.fault_tolerance.connect_timeout_seconds = 1
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"cannot reach the lighthouse at http://192.0.2.1:29510 within 1 s"):
        fault_tolerance.check_runtime(cfg)
    assert time.perf_counter() - t0 < 3.0


def test_torchtitans_fault_tolerance_keys_are_read_as_they_are(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")  # how torchtitan gives the address
    toml = tmp_path / "ft.toml"
    section = "[fault_tolerance]\nenable = true\nreplica_id = 1\ngroup_size = 2\nmin_replica_size = 1\n"
    toml.write_text(section + 'process_group = "gloo"\nprocess_group_timeout_ms = 5000\n')
    cfg = load_config(["--job.config_file", str(toml), *BASE], world_size=1)
    ft = cfg.fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size, ft.process_group_timeout_ms) == (True, 1, 2, 5000)
    assert fault_tolerance.config_problems(cfg) == []
    toml.write_text(section + 'semi_sync_method = "streaming"\n')
    with pytest.raises(ConfigError, match=r"fault_tolerance.semi_sync_method.*use None \(synchronous\), 'local_sgd'"):
        load_config(["--job.config_file", str(toml), *BASE], world_size=1)
    for method in ("local_sgd", "diloco"):
        toml.write_text(section + f'semi_sync_method = "{method}"\n')
        cfg = load_config(["--job.config_file", str(toml), *BASE], world_size=1)
        assert cfg.fault_tolerance.semi_sync_method == method and fault_tolerance.config_problems(cfg) == []
    on = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]
    (p,) = problems(*on, "--fault_tolerance.sync_steps=3", "--fault_tolerance.outer_lr=0.5")
    assert p.startswith("fault_tolerance.sync_steps, fault_tolerance.outer_lr: not read with")
    (p,) = problems(*on, "--fault_tolerance.semi_sync_method=local_sgd", "--fault_tolerance.outer_lr=0.5")
    assert p.startswith("fault_tolerance.outer_lr: not read with fault_tolerance.semi_sync_method = local_sgd")
    assert problems(*on, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.outer_lr=0.5") == []
