"""Checkpoints across layouts (one 4-process launch, see checkpoint_dist_worker.py) and faulty ranks (torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import worker_env

from titanlike.checkpoint import committed_checkpoints, read_meta, read_model_state_dict

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_dist_worker.py")
FAULT_WORKER = Path(__file__).with_name("checkpoint_fault_worker.py")
TOL = 1e-10
SAVE_STEP = 3
# (resumed case, the uninterrupted run under the same layout, the case whose step-3 it resumed from)
RESHARDS = [
    ("fsdp4_from_tp2_fsdp2", "fsdp4", "tp2_fsdp2"),  # tp2 x fsdp2 -> fsdp4 (dp 2 -> 4)
    ("single_from_fsdp2", "single", "fsdp2"),  # fsdp2 (async saves) -> one process, no process group (dp 2 -> 1)
    ("single_from_zero1_dp2", "single", "zero1_dp2"),  # ZeRO-1 (moments sharded over 2 replicas) -> one process
    ("zero1_dp2_from_fsdp2", "zero1_dp2", "fsdp2"),  # fsdp2 -> ZeRO-1
    ("tp2_from_fsdp2", "tp2", "fsdp2"),  # fsdp2 -> tp2 (dp 2 -> 1), checksums verified by both ranks
    ("tp2_from_corrupt_fsdp2", "tp2", "fsdp2"),  # same, after setting aside a newer step-6 with a flipped bit
    ("pp2_fsdp2_from_tp2_fsdp2", "pp2_fsdp2", "tp2_fsdp2"),  # tp2 x fsdp2 -> pp2 x fsdp2
    ("tied_zbv_pp2_from_tied_fsdp2", "tied_zbv_pp2", "tied_fsdp2"),  # tied embeddings: fsdp2 -> ZBV pp2
    # GPT-2, fused c_attn chunk-sharded under tp2 x fsdp2 -> one process
    ("gpt2_single_from_gpt2_tp2_fsdp2", "gpt2_single", "gpt2_tp2_fsdp2"),
    # Qwen3 (q/k norms over each rank's heads) under tp2+SP x fsdp2 -> one process
    ("qwen3_single_from_qwen3_tp2_sp_fsdp2", "qwen3_single", "qwen3_tp2_sp_fsdp2"),
    ("single_from_cp2", "single", "cp2"),  # context parallel 2 -> one process
    ("cp2_from_fsdp2", "cp2", "fsdp2"),  # cp 1 (fsdp2) -> cp 2
    ("muon_single_from_muon_tp2_fsdp2", "muon_single", "muon_tp2_fsdp2"),  # Muon: tp2 x fsdp2 -> one process
]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher in a session of its own; on a timeout kill it with every process it forked."""
    proc = subprocess.Popen(
        cmd,
        env=worker_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[1]} did not finish in {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    proc = _run([sys.executable, str(WORKER), str(out)], timeout=480)
    errors = "".join(p.read_text() for p in sorted(out.glob("error_rank*.txt")))
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{errors}\n{proc.stderr[-3000:]}"
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return out, results


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("resumed,reference,source", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_resume_under_another_layout_continues_the_loss_curve(cases, resumed, reference, source):
    out, results = cases
    res, ref, src = results[resumed], results[reference], results[source]
    assert res["resumed_at"] == SAVE_STEP and ref["resumed_at"] is None
    # Both layouts start from the same state: the saved run agrees with the reference up to the save ...
    assert _max_diff(src["losses"][:SAVE_STEP], ref["losses"][:SAVE_STEP]) <= TOL
    # ... and the run resumed under the reference's layout continues the reference's curve (float64).
    assert _max_diff(res["losses"], ref["losses"][SAVE_STEP:]) <= TOL
    # The data position is a global sample index: 3 steps x global batch 8, whatever the dp degree.
    assert read_meta(out / source / "checkpoint" / f"step-{SAVE_STEP}")["data_position"] == SAVE_STEP * 8
    # The final weights agree with the reference's as well.
    a = read_model_state_dict(out / resumed / "checkpoint" / "step-6")
    b = read_model_state_dict(out / reference / "checkpoint" / "step-6")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= TOL


@pytest.mark.parametrize("dtype", ["", "bf16_"])
def test_layout_invariant_resume_on_fewer_ranks_continues_bitwise(cases, dtype):
    """training.layout_invariant through the real trainer (float32 and bfloat16): fsdp4's 6 losses equal one
    process's bit for bit; its step-3 resumed on fsdp2 (and, float32, on one process) continues the same bits, and
    the final weights are equal (max |diff| exactly 0)."""
    out, results = cases
    full, single = results[f"inv_{dtype}fsdp4"], results[f"inv_{dtype}single"]
    assert len(full["losses"]) == 6 and full["losses"] == single["losses"]
    resumed = [f"inv_{dtype}fsdp2_from_inv_{dtype}fsdp4"] + ([] if dtype else ["inv_single_from_inv_fsdp4"])
    b = read_model_state_dict(out / f"inv_{dtype}fsdp4" / "checkpoint" / "step-6")
    for name in resumed:
        assert results[name]["resumed_at"] == SAVE_STEP
        assert results[name]["losses"] == full["losses"][SAVE_STEP:], name
        a = read_model_state_dict(out / name / "checkpoint" / "step-6")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_muon_under_tp2_fsdp2_trains_like_one_process_and_checkpoints_its_momentum(cases):
    """optimizer.name = Muon (torch's bfloat16 Newton-Schulz) under tp2 x fsdp2 on 4 ranks: every loss of the 6
    steps equals one process's (float64); the checkpoint holds one momentum buffer per matrix (no AdamW moments for
    them), AdamW's moments for the rest, and records the optimizer."""
    from titanlike.checkpoint import read_dcp_metadata

    out, results = cases
    assert _max_diff(results["muon_tp2_fsdp2"]["losses"], results["muon_single"]["losses"]) <= TOL
    step = out / "muon_tp2_fsdp2" / "checkpoint" / f"step-{SAVE_STEP}"
    keys = read_dcp_metadata(step).state_dict_metadata
    assert "optimizer.state.layers.0.attention.wq.weight.momentum_buffer" in keys
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" not in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys
    assert read_meta(step)["optimizer"] == "Muon"


def test_a_corrupted_newest_checkpoint_is_set_aside_under_two_ranks(cases):
    """The weight changed in step-6's rank-0 file was found while it was read (its CRC32C); with on_corrupt =
    "previous" both ranks went on from step-3 (the loss curve is checked above) and step-6 was saved anew."""
    out, _ = cases
    folder = out / "tp2_from_corrupt_fsdp2" / "checkpoint"
    aside = [p.name for p in folder.iterdir() if p.name.startswith("step-6.corrupt-")]
    assert len(aside) == 1 and list(committed_checkpoints(folder)) == [3, 6]
    log = (out / "log_rank0.txt").read_text()
    assert (
        "step-6' is corrupted: __0_0.distcp does not match its checksum at the entry "
        "'model.layers.1.feed_forward.w2.weight'" in log
    ), log[-3000:]
    assert (folder / "step-6" / "checksums.json").is_file()


def test_tied_checkpoint_loads_into_both_pipeline_copies(cases):
    """A tied model saved without pipelining (one parameter, one optimizer state under tok_embeddings.weight)
    resumes under ZBV pipelining, where pp rank 0 holds the embedding and the head as two parameters: both get the
    weights and the AdamW state (the loss curve is checked with the other layouts above)."""
    out, results = cases
    res = results["tied_zbv_pp2_from_tied_fsdp2"]
    assert res["resumed_at"] == SAVE_STEP
    assert res["tied_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert res["tied_state_equal"] and res["tied_exp_avg_norm"] > 0
    saved = read_model_state_dict(out / "tied_fsdp2" / "checkpoint" / f"step-{SAVE_STEP}")
    assert torch.equal(saved["tok_embeddings.weight"], saved["output.weight"])


def test_gpt2_checkpoint_exports_as_gpt2lmheadmodel(cases, tmp_path):
    """The GPT-2 checkpoint written under tp2 x fsdp2 (chunk-sharded c_attn) holds c_attn in the single-device
    q|k|v order: exported to Hugging Face it loads into transformers' GPT2LMHeadModel with the same logits as our
    model (or, without transformers installed, with GPT-2's names and Conv1D shapes)."""
    from titanlike.checkpoint import export_hf, model_args_of
    from titanlike.models import get_spec

    out, _ = cases
    step = out / "gpt2_tp2_fsdp2" / "checkpoint" / "step-6"
    args = model_args_of(step)
    ours = get_spec("gpt2").build(args).double()
    ours.load_state_dict(read_model_state_dict(step))
    hf_dir = export_hf(step, tmp_path / "hf")
    from safetensors.torch import load_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (args.dim, 3 * args.dim)  # Conv1D: (in, out)
    assert "lm_head.weight" not in tensors  # tied
    assert torch.equal(tensors["transformer.h.1.mlp.c_proj.weight"], ours.layers["1"].mlp.c_proj.weight.t())
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        return  # names and shapes checked above; the logits need transformers
    hf = GPT2LMHeadModel.from_pretrained(str(hf_dir), torch_dtype=torch.float64).eval()
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-10, diff


# seed written by several ranks -> (its layout, the seed written by one process it must equal)
SEED_WRITERS = {
    "seed_tp2_fsdp2": ({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}, "seed_single"),
    "seed_pp2_tp2": ({"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}, "seed_single"),
    "seed_tied_zbv_pp2": ({"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}, "seed_tied_single"),
}


def test_a_seed_checkpoint_written_by_any_layout_holds_the_one_process_weights(cases):
    """Seed checkpoints written under tp2 x fsdp2, pp2 x tp2 (4 ranks) and, tied, under ZBV pp2 (rank 0 holds both
    copies of the tied weight), each rank writing its own shards, hold exactly (float64, bitwise) the weights of
    the one written by one process, committed like any save (checksums, no temporary folder left), and
    checkpoint.json records the layout that wrote them."""
    out, results = cases
    for name, (layout, single) in SEED_WRITERS.items():
        ref = read_model_state_dict(out / single / "checkpoint" / "step-0")
        assert {v.dtype for v in ref.values()} == {torch.float64}
        folder = out / name / "checkpoint"
        world = layout["pp"] * layout["dp_shard"] * layout["tp"]
        assert results[name]["losses"] == [] and [p.name for p in folder.iterdir()] == ["step-0"]
        meta = read_meta(folder / "step-0")
        assert (meta["kind"], meta["step"], meta["world_size"], meta["layout"], meta["seed"], meta["dtype"]) == (
            "seed",
            0,
            world,
            layout,
            42,
            "float64",
        ), meta
        files = json.loads((folder / "step-0" / "checksums.json").read_text())["files"]
        assert sorted(f for f in files if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(world)]
        got = read_model_state_dict(folder / "step-0")
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), name


@pytest.mark.parametrize(
    "case,ranks,reference",
    [("single_from_seed_tp2_fsdp2", 1, "single"), ("pp2_fsdp2_from_seed_pp2_tp2", 4, "pp2_fsdp2")],
)
def test_a_seed_checkpoint_loads_into_another_layout(cases, case, ranks, reference):
    """A seed written by 4 ranks loads, resharded, into one process and into pp2 x fsdp2: after the load (before any
    step, the model built on the meta device) the full weights of every rank equal the one-process seed's bitwise,
    and the first step's loss is the one of a fresh start under that layout."""
    out, results = cases
    ref = read_model_state_dict(out / "seed_single" / "checkpoint" / "step-0")
    seen = set()
    for r in range(ranks):
        rec = torch.load(out / f"{case}.rank{r}.pt", weights_only=True)
        assert rec["meta_init"]
        for k, v in rec["weights"].items():
            assert torch.equal(v, ref[k]), (case, r, k)
            seen.add(k)
    assert seen == set(ref)
    assert results[case]["losses"][0] == results[reference]["losses"][0]


@pytest.mark.parametrize("case,reference", [("sig_tp2_fsdp2", "tp2_fsdp2"), ("sig_pp2_fsdp2", "pp2_fsdp2")])
def test_an_exit_signal_on_one_or_every_rank_saves_that_step_and_the_same_command_resumes_it(cases, case, reference):
    """SIGTERM while a step trains, on one rank of tp2 x fsdp2 (rank 3) and on every rank of pp2 x fsdp2 (1F1B):
    every rank finishes that step, the job saves it (between the interval saves) and stops; the same command then
    resumes at that step, nothing recomputed, and every loss equals the uninterrupted run's bitwise (float64)."""
    out, results = cases
    first, again, ref = results[case], results[f"{case}_again"], results[reference]
    step = {"sig_tp2_fsdp2": 2, "sig_pp2_fsdp2": 4}[case]
    assert first["preempted"] == step and first["losses"] == ref["losses"][:step]
    assert again["resumed_at"] == step and again["preempted"] is None and again["losses"] == ref["losses"][step:]
    expected = sorted({step, SAVE_STEP, 6})
    assert list(committed_checkpoints(out / case / "checkpoint")) == expected


FAULTS = ["hang_at_save", "hang_in_step", "exit_in_step", "sigstop_in_save"]
TIMEOUT_S = 5


def test_a_hung_or_dead_rank_ends_the_job_within_the_timeout(tmp_path):
    """2-rank jobs (side by side, see checkpoint_fault_worker.py) where rank 1 stops answering at the checkpoint
    save, stops answering before a training step, exits before a training step, or is SIGSTOPped inside a save
    (after its data files are written). Each job ends with rc 1 within comm.timeout_seconds plus a few seconds
    instead of hanging, with one line naming rank 1 and the operation, and every committed checkpoint stays
    loadable, none of the interrupted step."""
    from titanlike.data import asset_path

    args = [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "6",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--data.path",
        str(asset_path("corpus", "tinyshakespeare.txt")),
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--comm.timeout_seconds",
        str(TIMEOUT_S),
    ]
    proc = _run([sys.executable, str(FAULT_WORKER), str(tmp_path), *FAULTS, "--", *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    latency = {}
    for mode in FAULTS:
        dump = tmp_path / mode
        job = json.loads((dump / "job.json").read_text())
        log0 = (dump / "rank0.log").read_text()
        assert job["exit_codes"][0] == 1, (mode, job, log0[-3000:])  # rank 0 failed with an error ...
        assert job["seconds_after_fault"] < TIMEOUT_S + 15, (mode, job)  # ... soon after the fault
        latency[mode] = round(job["seconds_after_fault"], 1)
        saved = committed_checkpoints(dump / "checkpoint")
        errors = [ln for ln in log0.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, log0[-3000:]
        if mode == "hang_at_save":
            assert errors[0].startswith("error: rank 0: the checkpoint save of step 2 did not start on every rank"), (
                errors
            )
            assert "Ranks 1 failed to pass monitoredBarrier in 5000 ms" in errors[0], errors
            assert list(saved) == [1]
            assert not list((dump / "checkpoint").glob("step-2*"))  # no rank started writing it
        elif mode == "sigstop_in_save":
            assert errors[0].startswith(
                f"error: rank 0: the checkpoint save of step 2 failed: rank 1 did not answer within {TIMEOUT_S} s"
            ), errors
            assert list(saved) == [1]
        else:
            assert list(saved) == [1, 2], (mode, list(saved))
            assert errors[0].startswith(
                f"error: rank 0: training step 3 failed: rank 1 did not answer within {TIMEOUT_S} s"
            ), errors
            if mode == "hang_in_step":
                assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in errors[0], errors
        for path in saved.values():
            assert all(torch.isfinite(t).all() for t in read_model_state_dict(path).values())
    print(f"seconds from the fault to the end of the job (timeout {TIMEOUT_S} s): {latency}")
