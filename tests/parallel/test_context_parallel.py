"""Context parallelism without a process group: the chunk layout, the loader's cut, the up-front refusals.

The numerics (every CP layout equal to one device in float64, and the planted CP mutations caught) are in the
gate (tests/parallel/gate.py, pipeline_gate.py); the messages and their bytes against the planner in
tests/test_planner_gloo.py.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titanlike.config import load_config, model_args_from_config
from titanlike.data import build_dataloader, build_validation_loader
from titanlike.layout import layout_violations
from titanlike.parallel.context_parallel import chunk_ids, cp_positions, cp_shard, cp_unshard

ROOT = Path(__file__).resolve().parents[2]


def test_chunk_assignment_is_load_balanced():
    # cp 2, 8 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (the picture in docs/context_parallel.md)
    t = torch.arange(8)[None]
    assert cp_shard(t, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert cp_shard(t, 2, 1).tolist() == [[2, 3, 4, 5]]
    for cp in (1, 2, 4, 8):
        seq = 2 * cp * 3
        shards = [cp_shard(torch.arange(seq)[None], cp, r) for r in range(cp)]
        assert torch.equal(cp_unshard(torch.cat(shards, dim=1), cp), torch.arange(seq)[None])
        for r in range(cp):
            assert torch.equal(cp_positions(seq, cp, r), shards[r][0])
            assert sorted(chunk_ids(cp, r)) == [r, 2 * cp - 1 - r]
        # causal work (keys attended) is the same on every rank: chunk j costs j + 1 chunk-lengths of keys
        work = {sum(j + 1 for j in chunk_ids(cp, r)) for r in range(cp)}
        assert work == {2 * cp + 1}
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        cp_shard(torch.arange(6)[None], 2, 0)


def test_loader_hands_each_cp_rank_its_chunks_of_the_same_samples():
    tokens = np.arange(16 * 40 + 1, dtype=np.uint16)
    kw = dict(seq_len=16, global_batch_size=4, local_batch_size=2, dp_rank=0, dp_degree=2, seed=3)
    full = list(zip(range(4), build_dataloader(tokens, **kw)))
    for cp in (2, 4):
        per_rank = [list(zip(range(4), build_dataloader(tokens, cp_rank=r, cp_degree=cp, **kw))) for r in range(cp)]
        for k, (x, y) in full:
            xs = torch.cat([per_rank[r][k][1][0] for r in range(cp)], dim=1)
            ys = torch.cat([per_rank[r][k][1][1] for r in range(cp)], dim=1)
            assert torch.equal(cp_unshard(xs, cp), x) and torch.equal(cp_unshard(ys, cp), y)
    val = list(build_validation_loader(tokens, seq_len=16, batch_size=2, dp_rank=0, dp_degree=1, max_batches=2))
    val1 = list(
        build_validation_loader(
            tokens, seq_len=16, batch_size=2, dp_rank=0, dp_degree=1, max_batches=2, cp_rank=1, cp_degree=2
        )
    )
    assert torch.equal(val1[0][0], cp_shard(val[0][0], 2, 1))


def test_cp_layout_rules_are_reported_together():
    cfg = load_config([])
    p = cfg.parallelism
    p.context_parallel_degree, p.tensor_parallel_degree, p.enable_sequence_parallel = 4, 2, True
    cfg.training.seq_len = 36  # divisible by 4 but not by 2 x cp = 8
    cfg.model.kernels = "te"
    args = model_args_from_config(cfg, vocab_size=2048)
    text = "\n".join(layout_violations(cfg, 8, args))
    assert "seq_len 36 is not divisible by 2 x context_parallel_degree = 8" in text
    assert "model.kernels=te has no context-parallel path" in text
    cfg.model.kernels, cfg.float8.recipe = "torch", "tensorwise"
    assert any("float8 training is not proven under context parallelism" in v for v in layout_violations(cfg, 8, args))
    cfg.float8.recipe = ""
    cfg.training.seq_len, cfg.model.kernels = 40, "torch"  # 8 | 40, but a cp rank's 10 tokens are odd... for tp 4
    p.tensor_parallel_degree = 4
    text = "\n".join(layout_violations(cfg, 16, args))
    assert "the 10 tokens of a cp rank are not divisible by tensor_parallel_degree 4" in text
    p.tensor_parallel_degree, p.enable_sequence_parallel, cfg.training.seq_len = 1, False, 64
    for schedule in ("1F1B", "ZBVZeroBubble"):  # every schedule, the split-backward ones too (the pipeline gate)
        p.pipeline_parallel_degree, p.pipeline_parallel_schedule = 2, schedule
        assert not [v for v in layout_violations(cfg, 8, args) if "context" in v]


def test_train_py_refuses_a_bad_cp_layout_in_one_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--job.config_file",
            "configs/debug_model.toml",
            "--parallelism.context_parallel_degree",
            "3",
            "--training.seq_len",
            "64",
            "--job.dump_folder",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "WORLD_SIZE": "6", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        "error: training.seq_len 64 is not divisible by 2 x context_parallel_degree = 6 (each "
        "cp rank holds 2 of 6 load-balanced chunks); choose a multiple of 6"
    )
    assert not (tmp_path / "out").exists()


def test_apply_cp_swaps_the_shared_seams_of_every_model_and_refuses_a_module_without_one():
    """One transform for every model: the attention seam and the position seam of Llama and GPT-2 (and of a pipeline
    stage of them) are swapped; a module whose attention does not go through the seam is a one-line error, never a
    silent per-rank attention; one without a position seam needs positions=False said on purpose."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlike.models import get_spec
    from titanlike.models.decoder import AttentionCore
    from titanlike.parallel.context_parallel import ContextParallelAttention, ContextParallelPositions, apply_cp
    from titanlike.parallel.pipeline import build_stage

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        for name in ("llama3", "gpt2"):
            spec = get_spec(name)
            model = spec.build_meta(spec.flavors["tiny"].replace(vocab_size=64))
            for m in (model, build_stage(model, ["layers.1", "norm", "output"])):
                apply_cp(m, mesh)
                kinds = [type(x) for x in m.modules()]
                assert kinds.count(ContextParallelAttention) == len(m.layers) and AttentionCore not in kinds
                assert kinds.count(ContextParallelPositions) == 1
                assert m.positions(torch.zeros(1, 4, dtype=torch.long)).tolist() == [2, 3, 4, 5]  # rank 1's chunks

        class OwnAttention(torch.nn.Module):  # attention computed in place: no seam to swap
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(8, 24)

            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, -1)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        with pytest.raises(ValueError, match=r"^apply_cp: OwnAttention has no attention seam") as e:
            apply_cp(OwnAttention(), mesh)
        assert "\n" not in str(e.value)

        class SeamNoPositions(OwnAttention):
            def __init__(self):
                super().__init__()
                self.core = AttentionCore()

        with pytest.raises(ValueError, match=r"^apply_cp: SeamNoPositions has no position seam"):
            apply_cp(SeamNoPositions(), mesh)
        assert isinstance(apply_cp(SeamNoPositions(), mesh, positions=False).core, ContextParallelAttention)
    finally:
        dist.destroy_process_group()


def test_context_parallel_method_swaps_the_softmax_seams_and_keeps_state_passing():
    """``method="alltoall"`` / ``"ring"``: every softmax seam (the plain one with its window / sinks, the latent one)
    becomes its counterpart, the linear-attention seams keep state passing, the positions stay global; a method that
    is not implemented is refused; kv heads cp does not divide are repeated up to a multiple of cp (all-to-all)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlike.models import get_spec
    from titanlike.parallel.context_parallel import (
        ContextParallelAttention,
        UlyssesAttention,
        UlyssesLatentAttention,
        apply_cp,
        ulysses_kv_heads,
    )
    from titanlike.parallel.ring_attention import RingAttention, RingLatentAttention
    from titanlike.parallel.state_passing import ContextParallelGatedDelta

    assert ulysses_kv_heads(4, 2, 2) == 2 and ulysses_kv_heads(4, 2, 4) == 4 and ulysses_kv_heads(8, 2, 4) == 4
    assert ulysses_kv_heads(12, 4, 3) == 12 and ulysses_kv_heads(8, 1, 4) == 4
    with pytest.raises(ValueError, match=r"^context_parallel_method alltoall: the 2 query heads .* by cp 4"):
        ulysses_kv_heads(2, 2, 4)
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        kinds = {}
        for name in ("llama3", "gpt_oss", "deepseek_v3", "qwen3_next"):
            spec = get_spec(name)
            model = apply_cp(spec.build_meta(spec.flavors["tiny"].replace(vocab_size=64)), mesh, method="alltoall")
            kinds[name] = [type(m) for m in model.modules()]
            assert ContextParallelAttention not in kinds[name]
        assert kinds["llama3"].count(UlyssesAttention) == 2
        assert UlyssesLatentAttention in kinds["deepseek_v3"]
        assert UlyssesAttention in kinds["qwen3_next"] and ContextParallelGatedDelta in kinds["qwen3_next"]
        tiny = {n: get_spec(n).flavors["tiny"].replace(vocab_size=64) for n in ("gpt_oss", "llama3")}
        oss = apply_cp(get_spec("gpt_oss").build_meta(tiny["gpt_oss"]), mesh, method="alltoall")
        cores = [m for m in oss.modules() if isinstance(m, UlyssesAttention)]
        assert {c.window for c in cores} == {4, None} and all(c.sinks for c in cores)  # the seam's options kept
        ring = apply_cp(get_spec("gpt_oss").build_meta(tiny["gpt_oss"]), mesh, method="ring")
        cores = [m for m in ring.modules() if isinstance(m, RingAttention)]
        assert {c.window for c in cores} == {4, None} and all(c.sinks for c in cores)
        spec = get_spec("deepseek_v3")
        ds = apply_cp(spec.build_meta(spec.flavors["tiny"].replace(vocab_size=64)), mesh, method="ring")
        assert any(isinstance(m, RingLatentAttention) for m in ds.modules())
        with pytest.raises(ValueError, match=r"^apply_cp: context_parallel_method 'bogus' is not one of"):
            apply_cp(get_spec("llama3").build_meta(tiny["llama3"]), mesh, method="bogus")
        with pytest.raises(ValueError, match=r"^context_parallel_method hybrid: context_parallel_a2a_degree 2 must"):
            apply_cp(get_spec("llama3").build_meta(tiny["llama3"]), mesh, method="hybrid", a2a_degree=2)
    finally:
        dist.destroy_process_group()


def test_hybrid_splits_the_cp_mesh_into_ring_and_all_to_all_groups():
    """``method="hybrid"``: the cp mesh split into (ring, all-to-all) groups, the all-to-all innermost (neighbouring
    cp ranks); each ring rank holds the two load-balanced chunks of every rank of its group; every softmax seam
    (with its window / sinks, the latent one) becomes the hybrid core, Gated DeltaNet keeps state passing."""
    import gate
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlike.models import get_spec
    from titanlike.parallel.context_parallel import (
        HybridAttention,
        HybridLatentAttention,
        apply_cp,
        hybrid_layout,
    )
    from titanlike.parallel.state_passing import ContextParallelGatedDelta

    names = {lo.name: lo.world_size for lo in gate.LAYOUTS if "hybrid" in lo.args}
    for model in ("", "block_reset ", "gpt_oss ", "gpt_oss_block ", "ds_cp ", "ds_cp_block ", "qnext "):
        assert names[f"hybrid {model}cp4_a2a2"] == 4  # in the shared 4-rank gate launch
    assert names["hybrid cp4_a2a2_tp2_sp"] == 8
    assert sum(n.startswith("MUT hybrid") for n in names) == 3
    assert hybrid_layout(2)(2, 0) == (0, 7, 1, 6) and hybrid_layout(2)(2, 1) == (2, 5, 3, 4)
    assert sorted(j for g in range(2) for j in hybrid_layout(4)(2, g)) == list(range(16))
    dist.init_process_group("fake", rank=2, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        models = {}
        for name in ("gpt_oss", "deepseek_v3", "qwen3_next"):
            spec = get_spec(name)
            tiny = spec.flavors["tiny"].replace(vocab_size=64)
            models[name] = apply_cp(spec.build_meta(tiny), mesh, method="hybrid", a2a_degree=2)
        cores = [m for m in models["gpt_oss"].modules() if isinstance(m, HybridAttention)]
        assert {c.window for c in cores} == {4, None} and all(c.sinks for c in cores)
        core = cores[0]
        assert core.a2a_mesh.mesh.tolist() == [2, 3] and core.ring_mesh.mesh.tolist() == [0, 2]  # cp rank 2
        assert any(isinstance(m, HybridLatentAttention) for m in models["deepseek_v3"].modules())
        kinds = [type(m) for m in models["qwen3_next"].modules()]
        assert HybridAttention in kinds and ContextParallelGatedDelta in kinds
    finally:
        dist.destroy_process_group()


def test_all_to_all_and_ring_layouts_are_in_the_shared_gate_launches():
    """The all-to-all and ring methods' equality layouts run in the gate launches shared with every other layout
    (one launch per world size: tests/parallel/shared_launch.py; checked by test_parallel_gate.py and
    test_pipeline_gate.py): llama (causal, documents), gpt-oss (window + sinks), DeepSeek-V3 (MLA) and Qwen3-Next at
    cp 2 and cp 4, with tp 2 + SP, FSDP and pp 2, and their planted mutations."""
    import gate
    import pipeline_gate

    names = {lo.name for lo in gate.LAYOUTS + pipeline_gate.LAYOUTS if "context_parallel_method" in " ".join(lo.args)}
    for method in ("a2a", "ring"):
        for name in (
            "cp2",
            "block_reset cp2",
            "gpt_oss cp2",
            "gpt_oss_block cp2",
            "ds_cp cp2",
            "ds_cp_block cp2",
            "qnext cp2",
            "cp4",
            "block_reset cp4",
            "gpt_oss_block cp4",
            "ds_cp cp4",
            "cp2_tp2_sp",
            "block cp2_tp2_sp",
            "gpt_oss cp2_tp2_sp_ep2",
            "ds_cp_block cp2_tp2_sp_ep2",
            "cp2_fsdp2",
            "deep_tied cp2 pp2 1F1B",
            "block_deep cp2 pp2 1F1B",
            "gpt_oss_block_deep cp2 pp2 1F1B",
            "ds_deep_nomtp cp2 pp2 1F1B",
        ):
            assert f"{method} {name}" in names, f"{method} {name}"
    mutations = {lo.mutation for lo in gate.LAYOUTS if lo.name in names and lo.mutation}
    assert mutations == {
        "a2a_heads_order",
        "cp_chunks_wrong_order",
        "a2a_no_grad",
        "a2a_sinks_heads",
        "ring_step_skipped",
        "ring_merge_max",
        "ring_grads_kept",
        "ring_no_sinks",
        "ring_window_step_skipped",
        "ring_latent_weight_dropped",
    }


@pytest.mark.parametrize("documents", [True, False])
def test_whole_sequence_mask_is_the_document_mask_built_lazily(documents):
    """The all-to-all's whole-sequence mask (built inside the attention seam, so inside a compiled block) holds every
    field the constructor sets and attends as the eagerly built mask does, with and without a sliding window; and
    it compiles as one graph where the constructor's host read of the positions would break it."""
    import dataclasses

    from torch._dynamo.utils import counters

    from titanlike.models.masking import DocumentMask
    from titanlike.parallel.context_parallel import _whole_sequence_mask

    torch.manual_seed(0)
    b, s, windows = 2, 12, (None, 3)
    starts = torch.tensor([[0] * 5 + [5] * 7, [0] * 12]) if documents else torch.zeros(b, s, dtype=torch.int64)
    positions = torch.arange(s)
    local = DocumentMask(starts[:, :6], positions[:6], windows=windows, documents=documents)
    eager = DocumentMask(starts, positions, backend=local.backend, windows=windows, documents=documents)
    lazy = _whole_sequence_mask(starts, positions, local)
    assert {f.name for f in dataclasses.fields(DocumentMask)} <= set(vars(lazy)), "a field the helper does not set"
    assert not lazy._cache
    q, k, v = (torch.randn(b, 4, s, 8, dtype=torch.float64) for _ in range(3))

    def attend(mask, q, k, v):
        return torch.stack([mask.attend(q, k, v, window=w) for w in windows])

    expected = attend(eager, q, k, v)
    assert torch.equal(attend(lazy, q, k, v), expected)

    def whole(starts, q, k, v):
        return attend(_whole_sequence_mask(starts, torch.arange(s), local), q, k, v)

    counters.clear()
    compiled = torch.compile(whole, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(starts, q, k, v), expected, rtol=0, atol=1e-12)
    assert not counters["graph_break"]
