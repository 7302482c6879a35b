"""The planner against real runs: 4 gloo ranks execute titanlike's parallelisms on a small model, and every
collective they issue (count and bytes, per dimension and phase, as CommDebugMode counts them) and every byte they
hold in parameters, gradients and AdamW states equal the planner's numbers, on every rank.

Layouts (tests/planner_gloo_worker.py): TP+SP x FSDP in bf16; TP x FSDP in fp32 with full AC and a chunked
vocab-parallel loss; HSDP 2 x 2 with gradient accumulation; TP+SP with every-2nd-block AC; TP+SP with op-level
AC and FSDP resharding always; PP 2 x FSDP 2 with 1F1B and tied embeddings; PP 2 x TP+SP 2 interleaved with
gradient accumulation; CP 2 x FSDP (over dp_shard x cp); CP 2 x TP+SP 2 with full AC (K/V all-gathers recomputed);
Qwen3-MoE (a dense and an MoE layer, the sequence-wise aux loss on, routed round-robin: the planner's balanced load)
under ep 2 x FSDP 4 in bf16 (experts' own FSDP over dp_shard_mod_ep) and under TP+SP 2 x ep 4 x FSDP 2 with full AC
(ep borrowing tp: no collectives around the MoE block, its router over dp_shard_cp_tp, the aux loss's counts over tp,
per-head norm gradients over tp, the all-to-alls recomputed); Qwen3-MoE under PP 2 x ep 2 with 1F1B (a dense and an
MoE layer on the first stage, two MoE layers on the second); Qwen3-Next (a Gated DeltaNet and a gated attention
layer) under CP 2 x FSDP with full AC (the state maps and conv halos beside the K/V); DeepSeek-V3 tiny with one MTP
depth (MLA, a dense and an MoE layer, the depth's block MoE) under TP+SP 2 x ep 4 x FSDP 2 (the depth's embedding
lookup, norms, projection, block, shared head and loss; MLA's latent weights' gradients summed over tp; the depth's
MoE in its own FSDP groups, the rest of the depth in the root's), and under CP 2 x FSDP 2 (the latent gathers of
the three blocks, the window's token ids and the depth's labels). Every MoE case ends with
the step's balancing (the aux-loss terms and expert loads summed over dp x cp, x tp where ep borrows it; the log's
table over the stages). The vocabulary (250 rows) splits unevenly under tp 2 x dp_shard 2, so the padded FSDP
shards are exercised too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dist_utils import worker_env

WORKER = Path(__file__).resolve().parent / "planner_gloo_worker.py"
REPO = WORKER.parents[2]


def test_planner_matches_gloo_runs(tmp_path):
    out = tmp_path / "gloo.json"
    env = worker_env()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 25
    for name, ranks in cases.items():
        assert sorted(ranks) == ["0", "1", "2", "3"], name
        for rank, r in ranks.items():
            where = f"{name} rank {rank}"
            assert r["measured"] == r["planned"], (where, r["measured"], r["planned"])
            assert r["held"] == r["plan_memory"], (where, r["held"], r["plan_memory"])
            assert r["measured"], where
            # CommDebugMode itself counted exactly the recorded collectives (it cannot follow a pipeline schedule,
            # nor a module called twice in one forward: the shared head of an MTP depth)
            if not name.startswith(("pp", "ds_mtp", "ds_ring")):
                assert r["comm_debug_total"] == r["recorded_total"] > 0, where
    # Exercised: every dimension, op and phase the planner prices.
    keys = {k for ranks in cases.values() for r in ranks.values() for k in r["measured"]}
    for key in (
        "tp all_gather forward",
        "tp reduce_scatter backward",
        "tp all_reduce forward",
        "tp all_reduce backward",
        "dp_shard all_gather forward",
        "dp_shard all_gather backward",
        "dp_shard reduce_scatter backward",
        "dp_replicate all_reduce backward",
        "pp send any",
        "pp all_reduce step",
        "cp all_gather forward",
        "cp reduce_scatter backward",
        "cp all_gather backward",
        "cp all_to_all forward",
        "cp all_to_all backward",
        "cp send any",
        "dp_shard_cp reduce_scatter backward",
        "ep all_to_all forward",
        "ep all_to_all backward",
        "dp_shard_mod_ep all_gather forward",
        "dp_shard_mod_ep reduce_scatter backward",
        "dp_shard_cp_tp all_gather forward",
        "dp_shard_cp_tp reduce_scatter backward",
        "dp_cp all_reduce step",
        "dp_cp_tp all_reduce step",
    ):
        assert key in keys, key
    # After the optimizer step (ExpertBalancing.end_step) over the ranks that routed other tokens: the aux-loss
    # terms (float64 per MoE layer) and the stage's expert loads (int64, 8 experts per layer); under pp each stage's
    # own layers (1 on stage 0, 2 on stage 1), and the log's table over the stages rides with the tied grads
    for name, key in (
        ("moe_ep2_fsdp4_bf16", "dp_cp all_reduce step"),
        ("moe_tp2_sp_ep4_fsdp2_fullac", "dp_cp_tp all_reduce step"),
    ):
        assert all(r["measured"][key] == [2, 8 + 8 * 8] for r in cases[name].values()), name
    for rank, r in cases["pp2_moe_ep2_1f1b"].items():
        layers = 1 if rank in ("0", "1") else 2
        assert r["measured"]["dp_cp all_reduce any"] == [2, layers * (8 + 8 * 8)], (rank, r["measured"])
    # MoE (one MoE layer, one pass): the counts, the dispatch and the combine forward, the two transposes backward;
    # full AC reruns the forward's three in the backward
    for name, fwd, bwd in (("moe_ep2_fsdp4_bf16", 3, 2), ("moe_tp2_sp_ep4_fsdp2_fullac", 3, 5)):
        for rank, r in cases[name].items():
            m = r["measured"]
            assert (m["ep all_to_all forward"][0], m["ep all_to_all backward"][0]) == (fwd, bwd), (name, rank, m)
    # under pp 2 (2 microbatches): stage 0 holds one MoE layer, stage 1 two; CommDebugMode cannot follow a pipeline
    # schedule, the recorder does
    for rank, r in cases["pp2_moe_ep2_1f1b"].items():
        layers = 1 if rank in ("0", "1") else 2
        m = r["measured"]
        assert (m["ep all_to_all forward"][0], m["ep all_to_all backward"][0]) == (6 * layers, 4 * layers), (rank, m)
    # CP: per block and pass, one all-gather of K and one of V forward, one reduce-scatter of each gradient backward
    # (2 blocks); full AC repeats the two all-gathers in the backward. Bytes: the planner's, checked above.
    for rank, r in cases["cp2_fsdp2"].items():
        m = r["measured"]
        assert m["cp all_gather forward"][0] == 4 and m["cp reduce_scatter backward"][0] == 4, (rank, m)
        assert "cp all_gather backward" not in m, (rank, m)
    # gpt-oss: its sliding-window layer (window 4, chunks of 4) gathers 2 cp x 3 of the 16 positions, bounded by
    # the window: K and V of (batch 2, 12 tokens, 2 kv heads, 16) float32 = 3072 bytes each, the full layer's 4096
    for rank, r in cases["gpt_oss_cp2_fsdp2"].items():
        assert r["measured"]["cp all_gather forward"] == [4, 2 * 3072 + 2 * 4096], (rank, r["measured"])
    # DeepSeek-V3 with one MTP depth under TP+SP: the head's input gathered (and the vocab-parallel loss's three
    # all-reduces) twice, the embedding's output reduce-scattered twice (tok_embeddings and the depth's tied
    # lookup), the attention inputs of 3 blocks (the dense layer's ffn too; the MoE blocks are TokenLocal); 23
    # gradient all-reduces: 10 norms, the depth's eh_proj, 4 latent weights (wq_a, q_norm, wkv_a, kv_norm) x 3 blocks
    for rank, r in cases["ds_mtp_tp2_sp_ep4_fsdp2"].items():
        m = r["measured"]
        assert m["tp all_gather forward"][0] == 2 + 1 + 1 + 2 and m["tp reduce_scatter forward"][0] == 6, (rank, m)
        assert m["tp all_reduce forward"][0] == 2 * 3 and m["tp all_reduce backward"][0] == 23, (rank, m)
        assert m["dp_shard_cp_tp all_gather forward"][0] == 2, (rank, m)  # layers.1.moe and mtp.1.block.moe
    # under cp: 3 blocks x (the latent, the RoPE key) + the window's ids + the depth's labels (2 x 16 int64 each)
    for rank, r in cases["ds_mtp_cp2_fsdp2"].items():
        assert r["measured"]["cp all_gather forward"][0] == 3 * 2 + 1 + 1, (rank, r["measured"])
    for rank, r in cases["cp2_tp2_sp_fullac"].items():
        assert r["measured"]["cp all_gather backward"][0] == 4, (rank, r["measured"])
    # CP by all-to-all over heads: per block and pass q, k, v and the output, 4 forward and 4 backward (2 blocks);
    # full AC: the forward's 4 again in the backward. Llama at cp 4, batch 2: a rank's 4 tokens of 4 heads x 16 (q,
    # out) and of 2 kv heads repeated to 4 (k, v), float32 (2048 bytes each), 3/4 sent away: 4 x 1536 per block
    for rank, r in cases["a2a_cp4"].items():
        m = r["measured"]
        assert m["cp all_to_all forward"] == [8, 8 * 1536] and m["cp all_to_all backward"] == [8, 8 * 1536], m
        assert not any(k.startswith("cp all_gather") for k in m), (rank, m)
    for rank, r in cases["a2a_cp2_tp2_sp_fullac"].items():
        assert r["measured"]["cp all_to_all backward"][0] == 16, (rank, r["measured"])
    for rank, r in cases["gpt_oss_a2a_block_cp2_fsdp2"].items():
        assert r["measured"]["cp all_gather forward"] == [1, 2 * 16 * 8], (rank, r["measured"])  # the starts
    # MLA (3 blocks: 2 decoder blocks and the MTP depth's): no latent gathered, the expanded heads exchanged
    for rank, r in cases["ds_mtp_a2a_cp2_fsdp2"].items():
        assert r["measured"]["cp all_to_all forward"][0] == 3 * 4, (rank, r["measured"])
    # ring attention at cp 4 (2 blocks, batch 2, 4 local tokens of 2 kv heads x 16, float32: 1024 bytes per K or V):
    # forward 3 steps' K and V, backward K / V again and dK / dV home: (2 x 3 + 2 x 3 + 2 x 3) x 2 blocks sends
    for rank, r in cases["ring_cp4"].items():
        assert r["measured"]["cp send any"] == [36, 36 * 1024], (rank, r["measured"])
        assert not any(k.startswith("cp all_") for k in r["measured"]), (rank, r["measured"])
    # gpt-oss, window 2 at cp 4 (chunks of 2): the windowed layer needs steps 1 and 3 only (2 x 2 x 3 sends), the
    # full layer all 3 (2 x 3 x 3); 1024 bytes each as above
    for rank, r in cases["gpt_oss_ring_cp4"].items():
        assert r["measured"]["cp send any"] == [12 + 18, 30 * 1024], (rank, r["measured"])
    # MLA: the latent (32 wide) and the RoPE key (8) travel, not the expanded heads (batch 2, 8 local tokens,
    # float32: 2048 and 512 bytes); 2 blocks x 1 step x 3 sends each
    for rank, r in cases["ds_ring_cp2_fsdp2"].items():
        assert r["measured"]["cp send any"] == [12, 6 * 2048 + 6 * 512], (rank, r["measured"])
    # hybrid cp 4 = a2a 2 x ring 2 (each rank after the group's all-to-all: 8 tokens of 1 kv head x 16 = 1024 bytes
    # per K or V): per block 4 + 4 all-to-alls, sends forward 1 step of K and V, backward K / V again and dK / dV home
    for rank, r in cases["hybrid_block_cp4_a2a2"].items():
        assert r["measured"]["cp send any"] == [12, 12 * 1024], (rank, r["measured"])
        assert r["measured"]["cp all_to_all forward"][0] == 8, (rank, r["measured"])
        assert r["measured"]["cp all_gather forward"][0] == 1, (rank, r["measured"])
