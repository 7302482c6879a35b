"""The dry run: titanlike's parallelize functions at the real world size, in one process, on a fake process group.

The per-rank shard shapes it produces must equal the planner's analytic ones, and the activation probe (one block
run under FakeTensorMode) must equal the analytic activation bytes.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import plan as plan_cli
import pytest

from titanlike.config import model_args_from_config, parse_config
from titanlike.planner import block_activation_bytes, dry_run, rank_param_shards
from titanlike.planner.layout import Layout

REPO = Path(__file__).resolve().parents[2]


def test_405b_4d_layout_on_16384_ranks_end_to_end():
    out = io.StringIO()
    t0 = time.perf_counter()
    with redirect_stdout(out):
        rc = plan_cli.main(
            [
                "--job.config_file",
                str(REPO / "configs/llama3_405b.toml"),
                "--world-size",
                "16384",
                "--gpus-per-node",
                "8",
            ]
        )
    seconds = time.perf_counter() - t0
    text = out.getvalue()
    assert rc == 0, text
    assert seconds < 60
    for section in ("== validation", "== map", "== price per step", "== memory per rank", "== dry run"):
        assert section in text
    assert "OK: every layout rule holds" in text and "fits" in text and "WARNING" not in text
    assert re.search(r"tp\s+8\s+1\s+2048\s+1\s+nvlink\s+\[0\.\.7\]", text)
    assert re.search(r"pp\s+16\s+1024\s+1024\s+16\s+network", text)
    assert "64 parameters" in text and "analytic shard shapes: all equal" in text  # rank 0: stages 0 and 16
    assert re.search(r"activation probe: block layers\.0 .* held after its forward; equal", text)
    took = float(re.search(r"took ([\d.]+) s", text).group(1))
    assert took < 60


def test_dry_run_shards_and_probe_equal_the_analytic_ones_on_any_rank():
    cfg = parse_config(
        [
            "--model.flavor",
            "70B",
            "--training.seq_len",
            "4096",
            "--training.dtype",
            "bfloat16",
            "--training.local_batch_size",
            "8",
            "--parallelism.tensor_parallel_degree",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
            "--model.vocab_multiple",
            "8",
        ]
    )
    args = model_args_from_config(cfg, 100003)  # 100,008 rows: 12,501 per tp rank, uneven FSDP chunks
    layout = Layout.from_config(cfg, 1024, args, gpus_per_node=8)
    assert (layout.dp_shard, layout.dp_replicate, layout.stages_per_rank) == (16, 2, 2)
    for rank in (0, 1023, 777):  # first stage + embedding, last stage + head, a middle one
        d = dry_run(cfg, layout, args, rank=rank)
        analytic = {(s, p.name): p.local_shape for s, ps in rank_param_shards(layout, args, rank).items() for p in ps}
        assert {(r.stage, r.name): r.local_shape for r in d.params} == analytic
        assert {r.dtype for r in d.params} == {args_dtype()}
        tokens = layout.microbatch_size * layout.seq_len
        assert d.block_activation_bytes == block_activation_bytes(
            layout, args, tokens, layout.checkpointed(d.probe_layer)
        )
    wq = next(r for r in d.params if r.name.endswith("attention.wq.weight"))  # HSDP x TP: a 3-D layout
    assert wq.placements == (
        "(Replicate(), _StridedShard(dim=0, sf=8), Shard(dim=0)) on ('dp_replicate', 'dp_shard', 'tp')"
    )


def args_dtype():
    import torch

    return torch.float32  # master weights; FSDP's bf16 copies exist only while gathered


def test_405b_with_context_parallel_on_16384_ranks():
    """cp 4 x tp 8 (+SP) x pp 16 x HSDP (4 x 8) at 32k tokens: validated, priced (K/V all-gathers and their
    reduce-scatters per block, FSDP over dp_shard x cp) and dry-run with the CP attention core at 16,384 ranks."""
    # Its own interpreter: a second fake process group of another shape in the same process finds torch's cached
    # device-mesh groups of the first one (destroyed) and fails with "Could not resolve the process group".
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/plan.py"),
            "--job.config_file",
            str(REPO / "configs/llama3_405b.toml"),
            "--world-size",
            "16384",
            "--gpus-per-node",
            "8",
            "--parallelism.context_parallel_degree",
            "4",
            "--training.seq_len",
            "32768",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr[-3000:]
    assert "OK: every layout rule holds" in text and "fits" in text
    # tp 8 fills a node, so the cp groups (next to tp in the mesh) span 4 nodes: the one warning, and CP rides the
    # network
    assert text.count("WARNING") == 1 and "4096 of 4096 cp groups span nodes" in text
    assert re.search(r"cp\s+4\s+8\s+4096\s+4\s+network", text)
    # one K (or V): b S kv_heads/tp head_dim bf16 = 1 x 32768 x 1 x 128 x 2 B; 7 blocks x 16 microbatches x 2 x 4 stages
    assert re.search(r"cp\s+all_gather\s+forward\s+896\s+8\.00 MiB", text)
    assert re.search(r"cp\s+reduce_scatter\s+backward\s+896\s+8\.00 MiB", text)
    assert re.search(r"cp\s+all_gather\s+backward\s+896\s+8\.00 MiB\s+\S+ \S+\s+recomputed K and V \(full AC\)", text)
    assert "dp_shard_cp" in text and "sharded over dp_shard_cp 32" in text
    assert "analytic shard shapes: all equal" in text
    assert re.search(r"activation probe: block layers\.0 .*8192 tokens \(cp 4", text)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
        ["--parallelism.tensor_parallel_degree", "2"],
    ],
    ids=["fsdp8", "tp2_sp_op_ac", "tp2"],
)
def test_gpt2_block_activations_equal_the_probe(extra):
    """GPT-2's block (LayerNorm, fused q|k|v, GELU MLP: its spec's norm_kind / mlp_kind) has its own activation
    model; the analytic bytes equal the dry run's FakeTensorMode probe (the Llama model's formula was +75%)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/plan.py"),
            "--job.config_file",
            str(REPO / "configs/gpt2_small.toml"),
            "--world-size",
            "8",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"activation probe: block layers\.0 .* held after its forward; equal", proc.stdout), proc.stdout[
        -2000:
    ]


@pytest.mark.parametrize(
    "extra,mode",
    [
        (["--parallelism.enable_sequence_parallel"], "none"),
        (["--parallelism.enable_sequence_parallel", "--activation_checkpoint.mode", "selective"], "op"),
        (["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "full"], "full"),
    ],
    ids=["tp2_sp", "tp2_sp_op_ac", "cp2_full_ac"],
)
def test_qwen3_shards_and_block_activations_equal_the_dry_run(extra, mode):
    """Qwen3 0.6B (q 2048 = 16 heads x 128 wide for dim 1024, per-head q/k norms, tied embeddings): every
    parameter's TP and FSDP dims read off its sharding entries give the dry run's shard shapes (rank 0: the
    embedding's stage; rank 15: the head's, with its own copy of the tied weight), and the activation model
    (attention widths from n_heads x head_dim, the q/k norms' float32 copies) equals the FakeTensorMode probe."""
    cfg = parse_config(
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            "0.6B",
            "--training.seq_len",
            "256",
            "--training.dtype",
            "bfloat16",
            "--training.local_batch_size",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            *extra,
        ]
    )
    args = model_args_from_config(cfg)
    layout = Layout.from_config(cfg, 16, args, gpus_per_node=8)
    for rank in (0, 15) if mode == "none" else (0,):  # the first stage with the embedding, the last with the head
        d = dry_run(cfg, layout, args, rank=rank)
        analytic = {(s, p.name): p.local_shape for s, ps in rank_param_shards(layout, args, rank).items() for p in ps}
        assert {(r.stage, r.name): r.local_shape for r in d.params} == analytic
        tokens = layout.microbatch_size * layout.local_seq_len
        assert layout.checkpointed(d.probe_layer) == mode
        assert d.block_activation_bytes == block_activation_bytes(layout, args, tokens, mode)
    q_norm = next(r for r in d.params if r.name.endswith("attention.q_norm.weight"))
    assert q_norm.shape == (128,) and "Replicate()" in q_norm.placements  # replicated over tp, sharded over dp
