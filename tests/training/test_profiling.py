from __future__ import annotations

import json
import os

import pytest
import torch

from titanlike.config import JobConfig, Profiling
from titanlike.training.profiling import NO_PROFILER, maybe_profile


def _work():
    a = torch.randn(16, 16, requires_grad=True)
    (a @ a).sum().backward()


def test_off_by_default_is_a_shared_no_op(tmp_path):
    cfg = JobConfig()
    with maybe_profile(cfg, 0, str(tmp_path)) as prof:
        assert prof is NO_PROFILER and not prof.enabled
        prof.step()
    # Enabled, but not for this rank.
    cfg.profiling.enable_profiling = True
    assert maybe_profile(cfg, 1, str(tmp_path)) is NO_PROFILER
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "global_step,expected", [(0, ["iteration_3", "iteration_6"]), (4, ["iteration_6", "iteration_9"])]
)
def test_traces_for_the_scheduled_window(tmp_path, global_step, expected):
    pcfg = Profiling(
        enable_profiling=True,
        save_traces_folder="traces",
        profile_freq=3,
        profile_warmup=1,
        profile_active=1,
        ranks=[0, 2],
    )
    with maybe_profile(pcfg, 2, str(tmp_path), global_step=global_step) as prof:
        assert prof.enabled
        for _ in range(7 if global_step == 0 else 5):
            _work()
            prof.step()
    folders = sorted(os.listdir(tmp_path / "traces"))
    assert folders == expected
    for folder in folders:
        assert os.listdir(tmp_path / "traces" / folder) == ["rank2_trace.json"]
        trace = json.loads((tmp_path / "traces" / folder / "rank2_trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names
        # Exactly the active step is recorded (profile_active=1): the step just before the dump.
        step = int(folder.split("_")[1])
        assert {n for n in names if n and n.startswith("ProfilerStep#")} == {f"ProfilerStep#{step - 1}"}


def test_empty_ranks_means_every_rank_and_bad_window_is_an_error(tmp_path):
    pcfg = Profiling(enable_profiling=True, ranks=[], profile_freq=2, profile_warmup=0, profile_active=1)
    assert maybe_profile(pcfg, 5, str(tmp_path)).enabled
    with pytest.raises(ValueError, match="profile_freq"):
        maybe_profile(
            Profiling(enable_profiling=True, profile_freq=2, profile_warmup=2, profile_active=1), 0, str(tmp_path)
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path; with CUDA: test_memory_snapshot_on_cuda")
def test_memory_snapshot_without_cuda_writes_nothing(tmp_path):
    pcfg = Profiling(enable_memory_snapshot=True, profile_freq=1)
    with maybe_profile(pcfg, 0, str(tmp_path)) as prof:
        _work()
        prof.step()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory snapshots need CUDA")
def test_memory_snapshot_on_cuda(tmp_path):
    pcfg = Profiling(enable_memory_snapshot=True, save_memory_snapshot_folder="snap", profile_freq=2)
    with pytest.raises(RuntimeError, match="boom"):
        with maybe_profile(pcfg, 0, str(tmp_path)) as prof:
            for _ in range(3):
                x = torch.randn(256, 256, device="cuda")
                (x @ x).sum().item()
                prof.step()
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path / "snap")) == ["iteration_2", "iteration_3_exit"]
    for folder in ("iteration_2", "iteration_3_exit"):
        path = tmp_path / "snap" / folder / "rank0_memory_snapshot.pickle"
        assert path.stat().st_size > 0
