"""Single-process tests of the pipeline split: module names per stage, placement, stage construction, config rules."""

from __future__ import annotations

import pytest
import torch

from titanlike.config import JobConfig
from titanlike.errors import ConfigError
from titanlike.layout import (
    describe_split,
    layout_violations,
    parse_module_names,
    pipeline_stage_count,
    split_module_names,
    split_problem,
    stage_ids_for_rank,
    stage_module_names,
)
from titanlike.models import ModelArgs, Transformer
from titanlike.parallel.pipeline import build_stage

ARGS = ModelArgs(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def _layers(stage):
    return [int(n.split(".")[1]) for n in stage if n.startswith("layers.")]


def test_even_split_and_weighted_ends():
    assert split_module_names(4, 2) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    # 6 blocks + 1 (embedding) + 1 (head) = 8 units over 4 stages.
    assert [_layers(s) for s in split_module_names(6, 4, 1, 1)] == [[0], [1, 2], [3, 4], [5]]
    # Weighted first stage only: 7 + 1 = 8 units over 4 stages.
    assert [_layers(s) for s in split_module_names(7, 4, 1, 0)] == [[0], [1, 2], [3, 4], [5, 6]]
    # The embedding or the head alone can make a stage ...
    assert split_module_names(2, 4, 1, 1) == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]
    # ... but cannot weigh more than a stage's share.
    with pytest.raises(ConfigError, match="first_stage_less_layers 3 weighs more than a stage's 2 layers"):
        split_module_names(1, 2, 3, 0)


def _torchtitan_split(num_stages, num_layers, input_weight, output_weight):
    """torchtitan's generate_llm_fqn_per_model_part (torchtitan/distributed/pipeline_parallel.py), its arithmetic
    restated: blocks per stage."""
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, num_stages)
    out, current = [], 0
    for s in range(num_stages):
        n = per + (s < extra) - (input_weight if s == 0 else 0) - (output_weight if s == num_stages - 1 else 0)
        take = min(max(n, 0), num_layers - current)
        out.append(list(range(current, current + take)))
        current += take
    return out


def test_uneven_split_is_torchtitans():
    # DeepSeek-V3's 61 layers: the remainder on the first stages
    assert [len(_layers(s)) for s in split_module_names(61, 8)] == [8, 8, 8, 8, 8, 7, 7, 7]
    assert describe_split(split_module_names(61, 8)) == (
        "blocks per stage 8 8 8 8 8 7 7 7: [tok_embeddings, layers.0-7] [layers.8-15] [layers.16-23] [layers.24-31] "
        "[layers.32-39] [layers.40-46] [layers.47-53] [layers.54-60, norm, output]"
    )
    assert describe_split(split_module_names(2, 4, 1, 1)) == (
        "blocks per stage 0 1 1 0: [tok_embeddings] [layers.0] [layers.1] [norm, output]"
    )
    assert [len(_layers(s)) for s in split_module_names(61, 16)] == [4] * 13 + [3] * 3
    assert [len(_layers(s)) for s in split_module_names(61, 16, 1, 1)] == [3] + [4] * 14 + [2]
    assert split_module_names(5, 2) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "norm", "output"],
    ]
    # 5 layers, 4 virtual stages, 1 + 1: the head alone makes the last stage
    assert split_module_names(5, 4, 1, 1) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["norm", "output"],
    ]
    for n_layers in range(1, 20):
        for n_stages in range(1, 12):
            for a in range(3):
                for b in range(3):
                    if split_problem(n_layers, n_stages, a, b):
                        with pytest.raises(ConfigError):
                            split_module_names(n_layers, n_stages, a, b)
                        continue
                    names = split_module_names(n_layers, n_stages, a, b)
                    assert [_layers(s) for s in names] == _torchtitan_split(n_stages, n_layers, a, b)
                    assert all(names), (n_layers, n_stages, a, b)  # no stage empty
                    counts = [len(_layers(s)) + a * (i == 0) + b * (i == n_stages - 1) for i, s in enumerate(names)]
                    assert max(counts) - min(counts) <= 1  # the weighted units differ by at most one


def test_refusals_name_values_that_work():
    # a stage would be empty: at most as many stages as weighted layers
    message = split_problem(3, 4)
    assert "leave a stage empty in 4 stages; use at most 3 stages" in message
    assert split_problem(3, 3) is None
    assert "use at most 1, or fewer stages" in split_problem(2, 3, 2, 0)
    assert split_problem(2, 3, 1, 0) is None
    with pytest.raises(ConfigError, match="leave a stage empty"):
        split_module_names(60, 64)


def test_module_names_by_hand():
    specs = ["tok_embeddings, layers.0", "layers.1,layers.2", "layers.3, norm, output"]
    assert parse_module_names(specs, 4) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm", "output"],
    ]
    assert parse_module_names(["tok_embeddings", "layers.0,layers.1,norm,output"], 2)[0] == ["tok_embeddings"]
    bad = {
        "in order": ["tok_embeddings,layers.1", "layers.0,norm,output"],
        "exactly once": ["tok_embeddings,layers.0,layers.1", "layers.1,norm,output"],
        "first stage": ["layers.0", "tok_embeddings,layers.1,norm,output"],
        "last stage": ["tok_embeddings,layers.0,norm", "layers.1,output"],
        "unknown module": ["tok_embeddings,layers.0,attention", "layers.1,norm,output"],
        "is empty": ["tok_embeddings,layers.0,layers.1", " ", "norm,output"],
        "at least 2": ["tok_embeddings,layers.0,layers.1,norm,output"],
    }
    for match, spec in bad.items():
        with pytest.raises(ConfigError, match=match):
            parse_module_names(spec, 2)


def test_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 4, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank(r, 2, 6, "LoopedBFS") for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_ids_for_rank(r, 4, 8, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_ids_for_rank(1, 2, 4, "DualPipeV") == [1, 2]
    with pytest.raises(ValueError):
        stage_ids_for_rank(0, 2, 6, "ZBVZeroBubble")


def _full(args: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    with torch.device("cpu"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model = Transformer(args)
            model.init_weights()
        finally:
            torch.set_default_dtype(prev)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_stages_compose_to_the_full_model(tied):
    args = ARGS.replace(tie_embeddings=tied)
    full = _full(args)
    names = split_module_names(args.n_layers, 4, 1, 1)
    stages = [build_stage(full, n) for n in names]
    full_sd = full.state_dict()
    seen = set()
    for stage in stages:
        for fqn, p in stage.named_parameters():
            assert p.dtype == torch.float64 and torch.equal(p, full_sd[fqn])  # the plain model's FQNs and values
            assert all(p.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() for q in full.parameters())
            seen.add(fqn)
    assert seen == set(full_sd)  # with tied embeddings: both tok_embeddings.weight and output.weight
    if tied:
        assert stages[0].tok_embeddings.weight is not stages[-1].output.weight
    x = torch.randint(0, args.vocab_size, (2, 8))
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=1e-12)


def _cfg(**par) -> JobConfig:
    cfg = JobConfig()
    cfg.model.flavor = "debugmodel"  # 4 layers
    cfg.training.local_batch_size = 8
    cfg.training.seq_len = 32
    for k, v in par.items():
        setattr(cfg.parallelism, k, v)
    return cfg


def test_stage_module_names_follow_the_config():
    args = ARGS.replace(n_layers=4)
    cfg = _cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B")
    assert [_layers(s) for s in stage_module_names(cfg, args)] == [[0], [1], [2], [3]]
    cfg = _cfg(
        pipeline_parallel_degree=2,
        pipeline_parallel_module_names=["tok_embeddings,layers.0", "layers.1,layers.2,layers.3,norm,output"],
    )
    assert [_layers(s) for s in stage_module_names(cfg, args)] == [[0], [1, 2, 3]]
    cfg = _cfg(
        pipeline_parallel_degree=2,
        pipeline_parallel_layers_per_stage=2,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
    )
    assert pipeline_stage_count(cfg, args) == 3 and layout_violations(cfg, 2, args)  # 6 units in 3 stages on 2 ranks


def _violations(world=2, **par):
    args = ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=512)
    return " | ".join(layout_violations(_cfg(**par), world, args))


def test_config_rules_for_the_schedules():
    assert _violations(pipeline_parallel_degree=2) == ""
    for sched in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ):
        assert _violations(pipeline_parallel_degree=2, pipeline_parallel_schedule=sched) == "", sched
    # DualPipeV needs at least as many microbatches as stages (2 pp); 2 ranks x 2 stages = 4 > 2 microbatches.
    assert "DualPipeV needs" in _violations(
        pipeline_parallel_degree=2, pipeline_parallel_schedule="DualPipeV", pipeline_parallel_microbatch_size=4
    )
    # Interleaved schedules run rounds of pp microbatches: 5 microbatches on pp 2 make 2 rounds, which do not divide.
    cfg = _cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule="InterleavedZeroBubble")
    cfg.training.local_batch_size = 5
    args = ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=512)
    assert any("rounds" in v for v in layout_violations(cfg, 2, args))
    # layers_per_stage need not divide the layers (torchtitan's ceiling): 4 layers in stages of 3 -> 2 stages of 2;
    # with stages_per_rank too, both must give the same number of stages.
    assert _violations(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=3) == ""
    assert "layers_per_stage 2 makes 2" in _violations(
        pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=1, pipeline_parallel_stages_per_rank=1
    )
    # FSDP resharding after forward gives wrong gradients with the zero-bubble schedules.
    assert "reshard" in _violations(
        world=4,
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="ZBVZeroBubble",
        fsdp_reshard_after_forward="always",
    )
    # Split backward (input grads, later weight grads) vs features that allow one backward per forward.
    for sched in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        cfg = _cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule=sched)
        cfg.compile.enable = True
        assert any("compile.enable" in v for v in layout_violations(cfg, 2, args)), sched
        cfg = _cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule=sched)
        cfg.activation_checkpoint.mode = "selective"
        assert any("op-level selective" in v for v in layout_violations(cfg, 2, args)), sched
        cfg.activation_checkpoint.selective_ac_option = "2"  # every 2nd block fully checkpointed: fine
        assert layout_violations(cfg, 2, args) == [], sched
    cfg = _cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B")
    cfg.compile.enable = True
    cfg.activation_checkpoint.mode = "selective"
    assert layout_violations(cfg, 2, args) == []
    assert "must be on the last stage" in _violations(
        pipeline_parallel_degree=2,
        pipeline_parallel_module_names=["tok_embeddings,layers.0,norm", "layers.1,layers.2,layers.3,output"],
    )
