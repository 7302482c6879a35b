"""Layout-invariant training (tests/parallel/invariant_worker.py, in the shared launches of 2 and 4 ranks): one
process, FSDP 2, pp 2 (1F1B, LoopedBFS, InterleavedZeroBubble), FSDP 4, HSDP 2x2 and pp 2 ZBVZeroBubble x FSDP 2 train
bit for bit alike in float32 and bfloat16, and each planted mutation of the canonical tree breaks that."""

import invariant_worker
import pytest
import shared_launch

from titanlike.parallel.invariant import CanonicalTree, InOrder, canonical_row_blocks, tree_sum

# mutation -> what must break (the norm summed per shard moves the norm by an ulp; its float32 clip coefficient may
# round to the same value, so the weights can stay equal: the reported norm is part of the bitwise check)
EXPECTED_BREAK = {
    "linear_microbatches": ("loss", "grad_norm", "weights"),
    "linear_pipeline_microbatches": ("loss", "grad_norm", "weights"),
    "rank_order_changed": ("loss", "grad_norm", "weights"),
    "norm_per_shard": ("grad_norm",),
    "stage_leaves_rotated": ("loss", "grad_norm", "weights"),
    "linear_stage_microbatches_fsdp": ("loss", "grad_norm", "weights"),
    "fsdp_reduce_scatter_on": ("loss", "grad_norm", "weights"),
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def invariant_results(request, tmp_path_factory):
    world = request.param
    results = shared_launch.results("invariant", world, request, tmp_path_factory)
    print(f"\nlayout invariance, world size {world} (max |diff| over {invariant_worker.STEPS} steps):")
    for name, r in {**results["layouts"], **{f"MUT {k}": v for k, v in results["mutations"].items()}}.items():
        print(f"  {name:32s} loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} weights {r['weights']:.1e}")
    for name, r in results["default"].items():
        print(
            f"  default reduction {name:14s} loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} "
            f"weights {r['weights']:.1e}"
        )
    return world, results


def test_every_layout_is_bitwise_one_process(invariant_results):
    world, results = invariant_results
    expected = {
        f"{name} {dtype}"
        for name, (w, *_) in invariant_worker.LAYOUTS.items()
        if w == world
        for dtype in invariant_worker.DTYPES
    }
    assert set(results["layouts"]) == expected
    for name, r in results["layouts"].items():
        assert r["steps"] == invariant_worker.STEPS, name
        assert (r["loss"], r["grad_norm"], r["weights"]) == (0.0, 0.0, 0.0), (name, r)
        # clipping acted on every step (the norm exceeds max_norm 0.05 tenfold)
        assert min(r["ref_grad_norms"]) > 10 * 0.05, name


def test_the_accumulation_holds_log2_partial_sums(invariant_results):
    """A rank's V/dp x M leaves are summed pairwise: at most log2(leaves) + 1 partial gradient sums at once (one is
    the leaf itself), never all of them; plus, under a schedule running a stage's backwards out of microbatch order,
    the leaves waiting for their turn."""
    world, results = invariant_results
    for name, r in results["layouts"].items():
        _, replicate, shard, _, schedule = invariant_worker.LAYOUTS[name.split()[0]]
        leaves = invariant_worker.V // (replicate * shard) * invariant_worker.M
        waiting = invariant_worker.WAITING.get(schedule, 0)
        assert r["held"] <= leaves.bit_length() + waiting, (name, r["held"], leaves)


def test_mutations_break_the_bitwise_check(invariant_results):
    world, results = invariant_results
    expected = {
        m for m, (layout, _) in invariant_worker.MUTATIONS.items() if invariant_worker.LAYOUTS[layout][0] == world
    }
    assert set(results["mutations"]) == expected
    for name, r in results["mutations"].items():
        for field in EXPECTED_BREAK[name]:
            assert r[field] > 0.0, (name, field, r)


def test_the_default_reduction_is_not_bitwise(invariant_results):
    """Without layout_invariant the same layouts part from one process by float32 rounding (FSDP's per-micro-batch
    reduce-scatter, autograd's linear accumulation, the per-shard norm): what the option removes."""
    world, results = invariant_results
    assert results["default"]
    for name, r in results["default"].items():
        assert 0.0 < r["weights"] < 1e-4, (name, r)


def test_the_tree_is_one_tree_for_every_dp(invariant_results):
    world, results = invariant_results
    totals = set(results["tree"]["totals"].values())
    assert len(totals) == 1 and results["tree"]["linear"] not in totals


def test_canonical_tree_shapes():
    add = lambda a, b: f"({a}+{b})"  # noqa: E731
    tree = CanonicalTree(3, add=add)
    for x in "abcdef":
        tree.push(x)
    # each virtual rank's 3 leaves: (a+b) then c folded on; then the two virtual ranks
    assert tree.result() == "(((a+b)+c)+((d+e)+f))"
    assert tree_sum(list("abcd"), add=add) == "((a+b)+(c+d))"
    with pytest.raises(ValueError, match="not whole virtual ranks"):
        t = CanonicalTree(2, add=add)
        t.push("a")
        t.result()


def test_leaves_enter_the_tree_in_microbatch_order_whatever_their_arrival():
    """A pipeline stage's leaves carry their microbatch index: out of order they wait, the tree sees index order."""
    add = lambda a, b: f"({a}+{b})"  # noqa: E731
    ordered = InOrder(CanonicalTree(2, add=add))
    for i in (1, 3, 0, 2):
        ordered.push(i, "abcd"[i])
        assert ordered.held <= 3
    assert ordered.result() == "((a+b)+(c+d))"
    with pytest.raises(ValueError, match="came twice"):
        ordered = InOrder(CanonicalTree(2, add=add))
        ordered.push(0, "a")
        ordered.push(0, "a")
    with pytest.raises(ValueError, match="never came"):
        ordered = InOrder(CanonicalTree(2, add=add))
        ordered.push(1, "b")
        ordered.result()


@pytest.mark.parametrize("rows", [1, 3, 7, 10, 64, 128, 176, 1000])
def test_canonical_blocks_lie_in_one_shard_under_every_dp(rows):
    bounds = canonical_row_blocks(rows, 8)
    assert bounds[0] == 0 and bounds[-1] == rows and bounds == sorted(set(bounds))
    for dp in (1, 2, 4, 8):
        size = -(-rows // dp)
        shard = [min(k * size, rows) for k in range(dp + 1)]
        for a, b in zip(bounds, bounds[1:]):
            assert any(lo <= a and b <= hi for lo, hi in zip(shard, shard[1:])), (rows, dp, a, b)
