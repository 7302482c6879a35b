import itertools

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlike.data import (
    PackedWindows,
    build_dataloader,
    build_validation_loader,
    loader_position,
    set_loader_position,
)

SEQ = 4
N_WINDOWS = 23  # prime, so global batches straddle epoch boundaries at varying offsets
TOKENS = np.arange(SEQ * N_WINDOWS + 1, dtype=np.uint16)  # window w's inputs start at token w * SEQ
SEED = 7


def loader(**kw):
    args = dict(seq_len=SEQ, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1, seed=SEED)
    return build_dataloader(TOKENS, **(args | kw))


def windows_of(inputs: torch.Tensor) -> list[int]:
    return (inputs[:, 0] // SEQ).tolist()


def take(it, n):
    return [next(it) for _ in range(n)]


def reference_windows(first_sample: int, n_samples: int) -> list[int]:
    return PackedWindows(TOKENS, SEQ, seed=SEED).window_indices(range(first_sample, first_sample + n_samples)).tolist()


def step_windows(dp_degree, local_batch_size, n_steps, global_batch_size=8, num_workers=0, start_sample=0):
    """Per step, the windows of all ranks' micro-batches, concatenated in rank order."""
    accum = global_batch_size // (dp_degree * local_batch_size)
    per_rank = []
    for r in range(dp_degree):
        dl = loader(
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
            dp_rank=r,
            dp_degree=dp_degree,
            num_workers=num_workers,
            start_sample=start_sample,
        )
        per_rank.append([windows_of(x) for x, _ in itertools.islice(dl, n_steps * accum)])
    return [
        sum((per_rank[r][s * accum + m] for r in range(dp_degree) for m in range(accum)), []) for s in range(n_steps)
    ]


def test_shapes_labels_and_type():
    dl = loader(local_batch_size=2, dp_degree=2, dp_rank=1)
    assert isinstance(dl, StatefulDataLoader)
    inputs, labels = next(iter(dl))
    assert inputs.shape == labels.shape == (2, SEQ) and inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(labels, inputs + 1)  # TOKENS is arange: labels are the next tokens


def test_single_rank_follows_global_order_across_epochs():
    steps = step_windows(dp_degree=1, local_batch_size=8, n_steps=7)  # 56 samples > 2 epochs of 23
    assert sum(steps, []) == reference_windows(0, 56)


@pytest.mark.parametrize("dp_degree, local_batch_size", [(2, 4), (2, 1), (4, 2), (4, 1), (8, 1), (1, 2)])
def test_sample_order_is_independent_of_dp_degree_and_accumulation(dp_degree, local_batch_size):
    assert step_windows(dp_degree, local_batch_size, n_steps=4) == step_windows(1, 8, n_steps=4)


def test_rank_owns_contiguous_slice_as_consecutive_micro_batches():
    dl = loader(global_batch_size=12, local_batch_size=2, dp_rank=1, dp_degree=3)  # 2 micro-batches per step
    got = [windows_of(x) for x, _ in itertools.islice(dl, 4)]
    ref = reference_windows(0, 24)
    assert got == [ref[4:6], ref[6:8], ref[16:18], ref[18:20]]


def test_no_shuffle_reads_windows_in_storage_order():
    dl = loader(shuffle=False, local_batch_size=4, dp_degree=2, dp_rank=1)
    assert [windows_of(x) for x, _ in itertools.islice(dl, 3)] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 0]]


def test_position_is_exact_at_step_boundaries():
    dl = loader(global_batch_size=8, local_batch_size=2, dp_degree=2, dp_rank=0)  # 2 micro-batches per step
    assert loader_position(dl) == 0 and dl.state_dict() == {"global_sample": 0}
    it = iter(dl)
    positions = []
    for _ in range(6):
        next(it)
        positions.append(loader_position(dl))
    assert positions == [0, 8, 8, 16, 16, 24]  # mid-step it still names the unfinished step's start


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_under_another_layout_yields_the_uninterrupted_samples(num_workers):
    uninterrupted = step_windows(1, 8, n_steps=6)
    # Train 3 steps at dp=2 (accumulating 2 micro-batches), checkpoint rank 0's position.
    dl = loader(local_batch_size=2, dp_degree=2, dp_rank=0, num_workers=num_workers)
    it = iter(dl)
    take(it, 6)
    state = dl.state_dict()
    assert state == {"global_sample": 24}
    # Resume at dp=4 with a different micro-batch size, through load_state_dict and through start_sample.
    resumed = []
    for r in range(4):
        dl2 = loader(local_batch_size=1, dp_degree=4, dp_rank=r, num_workers=num_workers)
        dl2.load_state_dict(state)
        resumed.append([windows_of(x) for x, _ in itertools.islice(dl2, 6)])
    assert [sum((resumed[r][s * 2] + resumed[r][s * 2 + 1] for r in range(4)), []) for s in range(3)] == uninterrupted[
        3:
    ]
    assert (
        step_windows(4, 1, n_steps=3, start_sample=state["global_sample"], num_workers=num_workers) == uninterrupted[3:]
    )


def test_workers_yield_the_same_stream_and_position():
    ref_dl = loader(local_batch_size=2, dp_degree=2, dp_rank=1)
    ref = [windows_of(x) for x, _ in itertools.islice(ref_dl, 10)]
    dl = loader(local_batch_size=2, dp_degree=2, dp_rank=1, num_workers=2)
    it = iter(dl)
    got = [windows_of(x) for x, _ in take(it, 7)]  # workers prefetch ahead; the position must not
    assert got == ref[:7]
    assert loader_position(dl) == 24  # 3 full steps of 2 micro-batches; the 7th started step 4
    # A fresh iterator (fresh workers) continues at the exact micro-batch, mid-step.
    got += [windows_of(x) for x, _ in itertools.islice(dl, 3)]
    assert got == ref


def test_new_iterator_continues_where_the_consumer_stopped():
    dl = loader(local_batch_size=2, dp_degree=2, dp_rank=0)
    ref = [windows_of(x) for x, _ in itertools.islice(loader(local_batch_size=2, dp_degree=2, dp_rank=0), 5)]
    first = [windows_of(x) for x, _ in itertools.islice(dl, 3)]
    rest = [windows_of(x) for x, _ in itertools.islice(dl, 2)]
    assert first + rest == ref


def test_set_position_and_start_sample_agree():
    a = loader(local_batch_size=4, dp_degree=2, dp_rank=1, start_sample=40)
    b = loader(local_batch_size=4, dp_degree=2, dp_rank=1)
    set_loader_position(b, 40)
    assert loader_position(a) == loader_position(b) == 40
    xa = [windows_of(x) for x, _ in itertools.islice(a, 3)]
    assert xa == [windows_of(x) for x, _ in itertools.islice(b, 3)]
    assert xa[0] == reference_windows(44, 4)
    # Positions need not be multiples of the global batch size (e.g. after a batch-size change).
    c = loader(start_sample=5)
    assert windows_of(next(iter(c))[0]) == reference_windows(5, 8)
    assert loader_position(c) == 13


def test_layout_errors():
    with pytest.raises(ValueError, match="global_batch_size 8 is not divisible by dp_degree 3 x local_batch_size 1"):
        loader(local_batch_size=1, dp_degree=3)
    with pytest.raises(
        ValueError,
        match="global_batch_size 8 is not divisible by dp_degree 2 x local_batch_size 3; use a multiple of 6",
    ):
        loader(local_batch_size=3, dp_degree=2)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got 2"):
        loader(local_batch_size=1, dp_degree=2, dp_rank=2)
    with pytest.raises(ValueError, match="dp_degree must be >= 1"):
        loader(dp_degree=0)
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        loader(local_batch_size=0)
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        loader(num_workers=-1)
    with pytest.raises(ValueError, match="non-negative integer global sample index"):
        loader(start_sample=-8)
    dl = loader()
    for bad in ({}, {"global_sample": 1.5}, {"global_sample": True}, [3]):
        with pytest.raises(ValueError, match="global_sample|global sample index"):
            dl.load_state_dict(bad)
    with pytest.raises(ValueError, match="cannot fill one window"):
        build_dataloader(
            TOKENS[:3], seq_len=SEQ, global_batch_size=1, local_batch_size=1, dp_rank=0, dp_degree=1, seed=0
        )


def val_windows(dp_rank, dp_degree, batch_size=2, max_batches=None):
    vl = build_validation_loader(
        TOKENS, seq_len=SEQ, batch_size=batch_size, dp_rank=dp_rank, dp_degree=dp_degree, max_batches=max_batches
    )
    return [windows_of(x) for x, _ in vl]


def test_validation_loader_is_finite_deterministic_and_disjoint():
    vl = build_validation_loader(TOKENS, seq_len=SEQ, batch_size=2, dp_rank=1, dp_degree=3)
    assert len(vl) == 3  # 23 windows // (2 * 3)
    first, second = [[(x.clone(), y.clone()) for x, y in vl] for _ in range(2)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    assert all(torch.equal(y, x + 1) for x, y in first)
    ranks = [sum(val_windows(r, 3), []) for r in range(3)]
    assert sorted(sum(ranks, [])) == list(range(18))  # disjoint, every full round of windows, tail dropped
    assert val_windows(0, 3) == [[0, 1], [6, 7], [12, 13]]
    # The first K batches of D ranks cover the first K * D batches of one rank.
    assert sorted(sum((sum(val_windows(r, 2, max_batches=2), []) for r in range(2)), [])) == sum(
        val_windows(0, 1, max_batches=4), []
    )
    assert len(val_windows(0, 1, max_batches=2)) == 2


def test_validation_loader_errors():
    with pytest.raises(ValueError, match="too few for one batch of 8 on each of 4 ranks; raise val_fraction"):
        build_validation_loader(TOKENS, seq_len=SEQ, batch_size=8, dp_rank=0, dp_degree=4)
    with pytest.raises(ValueError, match="max_batches must be >= 1"):
        build_validation_loader(TOKENS, seq_len=SEQ, batch_size=1, dp_rank=0, dp_degree=1, max_batches=0)
    with pytest.raises(ValueError, match="too few"):
        build_validation_loader(TOKENS[:0], seq_len=SEQ, batch_size=1, dp_rank=0, dp_degree=1)
