"""titanlike.init: every element a pure function of (seed, key, index); any subset of a tensor is generated alone
and equals the same elements of the whole; the models' init plans cover every parameter."""

import math

import pytest
import torch

from titanlike.init import (
    TILE_1D,
    TILE_COLS,
    TILE_ROWS,
    Init,
    InitPlanError,
    constant,
    generate,
    init_parameters,
    normal,
    ones,
    trunc_normal,
    zeros,
)
from titanlike.models import get_spec


def _subsets(n: int, g: torch.Generator) -> list[torch.Tensor]:
    """Index lists of one dim: whole, contiguous ranges across tile edges, strided pieces, random, empty."""
    out = [torch.arange(n), torch.arange(n // 3, n), torch.arange(0, n, 3), torch.arange(n)[:0]]
    k = max(1, n // 5)
    out.append(torch.randperm(n, generator=g)[:k].sort().values)
    return out


@pytest.mark.parametrize("shape", [(7,), (TILE_1D + 5,), (TILE_ROWS + 3, 2 * TILE_COLS + 1), (3, 5, 300), (1, 1)])
@pytest.mark.parametrize("init", [normal(0.02), trunc_normal(0.5, a=-0.6, b=0.9, mean=0.1)], ids=str)
def test_any_subset_equals_the_same_elements_of_the_whole(shape, init):
    full = generate(init, 7, "w", shape, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    per_dim = [_subsets(n, g) for n in shape]
    for trial in range(12):
        idx = [s[(trial + d) % len(s)] for d, s in enumerate(per_dim)]
        part = generate(init, 7, "w", shape, idx, dtype=torch.float64)
        expect = full
        for d, ix in enumerate(idx):
            expect = expect.index_select(d, ix)
        assert torch.equal(part, expect), (shape, [len(i) for i in idx])


def test_values_depend_on_seed_key_and_shape_only():
    a = generate(normal(1.0), 0, "layers.0.w", (300, 300))
    assert torch.equal(a, generate(normal(1.0), 0, "layers.0.w", (300, 300)))
    assert not torch.equal(a, generate(normal(1.0), 1, "layers.0.w", (300, 300)))
    assert not torch.equal(a, generate(normal(1.0), 0, "layers.1.w", (300, 300)))
    # tiles differ from each other (no repeated stream)
    assert not torch.equal(a[:TILE_ROWS, :TILE_COLS][:44], a[TILE_ROWS : 2 * TILE_ROWS, :TILE_COLS][:44])
    # one value set for every dtype: float32 / bf16 are the float64 values rounded
    a64 = generate(normal(1.0), 0, "w", (50, 70), dtype=torch.float64)
    assert torch.equal(generate(normal(1.0), 0, "w", (50, 70), dtype=torch.bfloat16), a64.to(torch.bfloat16))


def test_distributions():
    n = (1000, 1000)
    x = generate(normal(0.02, mean=0.5), 3, "x", n, dtype=torch.float64)
    assert abs(x.mean().item() - 0.5) < 1e-3 and abs(x.std().item() - 0.02) < 1e-4
    t = generate(trunc_normal(1.0, a=-1.0, b=2.0), 3, "t", n, dtype=torch.float64)
    assert t.min().item() >= -1.0 and t.max().item() <= 2.0
    # mean of a standard normal truncated to [-1, 2]: (phi(-1) - phi(2)) / (Phi(2) - Phi(-1))
    phi = lambda v: math.exp(-v * v / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda v: (1 + math.erf(v / math.sqrt(2))) / 2  # noqa: E731
    assert abs(t.mean().item() - (phi(-1) - phi(2)) / (cdf(2) - cdf(-1))) < 3e-3
    assert generate(zeros(), 0, "z", (3, 4)).abs().sum() == 0
    assert torch.equal(generate(ones(), 0, "o", (3,)), torch.ones(3))
    assert torch.equal(generate(constant(2.5), 0, "c", (2,)), torch.full((2,), 2.5))
    with pytest.raises(ValueError):
        Init("uniform")


@pytest.mark.parametrize("name", ["llama3", "gpt2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_init_plans_cover_every_parameter_and_tie_by_key(name, tied):
    import dataclasses

    spec = get_spec(name)
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=96, tie_embeddings=tied)
    model = spec.build(args).double()
    model.init_weights(seed=5)
    again = spec.build(args).double()
    again.init_weights(seed=5)
    for (k, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), k
    # a last pipeline stage's own copy of the tied head is generated as the embedding
    from titanlike.parallel.pipeline import build_stage

    last = build_stage(spec.build(args), ["norm", "output"]).double()
    last.init_weights(seed=5)
    if tied:
        assert torch.equal(last.output.weight, model.tok_embeddings.weight)
    else:
        assert torch.equal(last.output.weight, model.output.weight)
    # a block alone (AC, tests) gives the full model's values for that block
    block = model.layers["1"]
    before = {k: v.clone() for k, v in block.state_dict().items()}
    block.init_weights(seed=5)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_a_parameter_without_a_distribution_is_named_before_anything_is_written():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(InitPlanError, match=r"2 parameter\(s\): 1.weight, 1.bias"):
        init_parameters(m, {r"0\.weight": normal(1.0), r"0\.bias": zeros()}, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    init_parameters(m, {r"0\..*": normal(1.0), r"1\.weight": ones(), r"1\.bias": zeros()}, seed=0)
    assert torch.equal(m[1].weight, torch.ones(4))


def test_shards_on_four_ranks_equal_the_single_device_init(request, tmp_path_factory):
    """A 4-rank gloo worker (init_worker.py, in the session's 4-rank launch: tests/parallel/shared_launch.py):
    local_indices against DTensor's own layout (distribute_tensor) for Shard, uneven and empty shards, _StridedShard,
    2-D meshes; and init_parameters on FSDP2 / TP x FSDP2 modules (uneven shapes) against the whole tensor."""
    import shared_launch

    assert shared_launch.results("init", 4, request, tmp_path_factory)["checked"] > 0
