"""Vocab-parallel cross entropy on 2 and 4 gloo ranks (loss_parallel_worker.py, in the session's launch of each
world size: tests/parallel/shared_launch.py)."""

import pytest
import shared_launch
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from titanlike.parallel.loss_parallel import _shard_size_and_offset, _vocab_mesh_dim, loss_parallel_cross_entropy

TOL = 1e-12


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    return shared_launch.results("loss", request.param, request, tmp_path_factory)  # the session's launch of that size


def _cases(results, *, exclude=("mutation_", "bf16")):
    return {name: r for name, r in results.items() if not name.startswith(exclude)}


def test_loss_and_grad_equal_full_cross_entropy(results):
    cases = _cases(results)
    assert len(cases) >= 15
    for name, r in cases.items():
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (name, r)


def test_equal_torch_loss_parallel(results):
    compared = {name: r for name, r in _cases(results).items() if "torch_loss_err" in r}
    assert len(compared) >= 8  # sum/mean, ignore_index, chunked, uneven shards
    for name, r in compared.items():
        assert r["torch_loss_err"] <= TOL and r["torch_grad_err"] <= TOL, (name, r)


def test_loss_identical_on_all_ranks(results):
    for name, r in _cases(results).items():
        assert r["rank_spread"] == 0.0, (name, r)


def test_mean_of_zero_tokens_is_zero(results):
    for chunk in ("None", "4"):
        r = results[f"all_ignored_mean_chunk{chunk}"]
        assert r["loss_is_finite"] == 1.0 and r["loss_err"] == 0.0 and r["grad_err"] == 0.0, r


def test_three_all_reduces_per_forward_chunk_none_in_backward(results):
    counted = {name: r for name, r in _cases(results).items() if "fwd_all_reduces" in r}
    for name, r in counted.items():
        # Through _all_reduce, and everything CommDebugMode sees (so nothing bypasses _all_reduce).
        assert r["fwd_all_reduces"] == r["fwd_comm"] == r["expected_fwd"], (name, r)
        assert r["fwd_order_ok"] == 1.0, (name, r)
        assert r["bwd_all_reduces"] == r["bwd_comm"] == 0, (name, r)
    assert {r["expected_fwd"] for r in counted.values()} == {3, 12}  # unchunked and 4 chunks


def test_bf16_logits(results):
    r = results["bf16"]
    assert r["dtype_ok"] == 1.0  # float32 loss, bf16 gradient
    assert r["loss_err"] <= 1e-5
    # Rounding to bf16 (half an ulp: 2**-8 relative) plus float32 arithmetic.
    assert r["grad_err"] <= r["ref_grad_max"] * (2**-8 + 1e-5), r


@pytest.mark.parametrize("dropped", ["max", "sum_exp", "target"])
def test_planted_mutations_are_caught(results, dropped):
    for chunk in ("None", "4"):
        r = results[f"mutation_drop_{dropped}_chunk{chunk}"]
        # The comparison the other tests make must fail by a wide margin.
        assert r["loss_err"] > 1e-3, r
        if dropped != "target":  # the target logit does not enter the backward
            assert r["grad_err"] > 1e-3, r


@pytest.mark.parametrize("size", [0, 1, 5, 11, 12, 13])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_shard_layout_is_torch_chunk(size, num_shards):
    expected = [c.shape[0] for c in torch.arange(size).chunk(num_shards)]
    expected += [0] * (num_shards - len(expected))  # torch.chunk may return fewer chunks; Shard pads with empty
    layout = [_shard_size_and_offset(size, num_shards, i) for i in range(num_shards)]
    assert [s for s, _ in layout] == expected
    assert [o for _, o in layout] == [min(sum(expected[:i]), size) for i in range(num_shards)]


def test_vocab_mesh_dim_and_refusals():
    assert _vocab_mesh_dim([Shard(2)], 3) == 0
    assert _vocab_mesh_dim([Shard(-1)], 2) == 0
    assert _vocab_mesh_dim([Replicate(), Shard(1)], 2) == 1
    for bad in ([Shard(0)], [Replicate()], [Shard(0), Shard(1)], [Partial(), Shard(1)], [Shard(1), Shard(1)]):
        with pytest.raises(ValueError, match="vocab"):
            _vocab_mesh_dim(bad, 2)
    with pytest.raises(TypeError, match="DTensor"):
        loss_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
