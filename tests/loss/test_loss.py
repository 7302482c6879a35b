import pytest
import torch
import torch.nn.functional as F

from titanlike.loss import cross_entropy_loss


def _data(shape=(3, 7), vocab=13, dtype=torch.float64, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    for idx, value in ignore:
        labels.view(-1)[idx] = value
    return logits, labels


def _loss_and_grad(fn, logits):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf)
    # A non-unit upstream gradient checks that the backward scales by it.
    (loss * 1.7).backward()
    return loss.detach(), leaf.grad


def _reference(logits, labels, ignore_index, reduction):
    """F.cross_entropy on the float64 flattened logits; "mean" of zero tokens is defined as 0."""

    def fn(x):
        flat = x.reshape(-1, x.shape[-1])
        loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
        if reduction == "mean":
            loss = loss / (labels != ignore_index).sum().clamp(min=1)
        return loss

    return _loss_and_grad(fn, logits)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 21, 100])
@pytest.mark.parametrize(
    "ignore_index, ignore", [(-100, ()), (-100, [(0, -100), (5, -100), (20, -100)]), (3, [(2, 3), (9, 3)])]
)
def test_matches_f_cross_entropy_float64(reduction, chunk_size, ignore_index, ignore):
    logits, labels = _data(ignore=ignore)
    ours = _loss_and_grad(
        lambda x: cross_entropy_loss(x, labels, ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size),
        logits,
    )
    # Straight F.cross_entropy with the reduction built in (no zero-token case here).
    ref = _loss_and_grad(
        lambda x: F.cross_entropy(
            x.reshape(-1, 13), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
        ),
        logits,
    )
    assert ours[0].dtype == torch.float64
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-12)
    ignored = (labels == ignore_index).reshape(-1)
    assert torch.count_nonzero(ours[1].reshape(-1, 13)[ignored]) == 0


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_all_ignored_gives_zero_without_nan(chunk_size):
    logits, labels = _data()
    labels.fill_(-100)
    for reduction in ("sum", "mean"):
        loss, grad = _loss_and_grad(
            lambda x: cross_entropy_loss(x, labels, reduction=reduction, chunk_size=chunk_size), logits
        )
        assert loss.item() == 0.0
        assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_empty_batch(chunk_size):
    logits, labels = _data(shape=(0,))
    loss, grad = _loss_and_grad(
        lambda x: cross_entropy_loss(x, labels, reduction="mean", chunk_size=chunk_size), logits
    )
    assert loss.item() == 0.0 and grad.shape == logits.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_computed_in_float32(dtype):
    logits, labels = _data(shape=(4, 16), vocab=257, dtype=dtype, ignore=[(3, -100)])
    ref_loss, ref_grad = _reference(logits.double(), labels, -100, "mean")  # float64 on the same rounded logits
    for chunk_size in (None, 7):
        loss, grad = _loss_and_grad(
            lambda x: cross_entropy_loss(x, labels, reduction="mean", chunk_size=chunk_size), logits
        )
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
        # Errors left: rounding the gradient to the logits dtype, and float32 arithmetic (|logits| ~ 10).
        tol = ref_grad.abs().max().item() * (2 * torch.finfo(dtype).eps + 64 * torch.finfo(torch.float32).eps)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=tol)


def test_chunked_equals_unchunked_float32():
    logits, labels = _data(shape=(8, 32), vocab=1000, dtype=torch.float32, ignore=[(1, -100), (100, -100)])
    loss, grad = _loss_and_grad(lambda x: cross_entropy_loss(x, labels), logits)
    for chunk_size in (1, 3, 64, 256, 10_000):
        c_loss, c_grad = _loss_and_grad(lambda x: cross_entropy_loss(x, labels, chunk_size=chunk_size), logits)
        torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(c_grad, grad, rtol=1e-5, atol=1e-7)


def test_chunked_saves_only_logits_and_per_token_stats():
    """The chunked autograd graph keeps the bf16 logits and O(tokens) tensors, no (tokens x vocab) float32 copy."""
    tokens, vocab = 64, 512
    logits, labels = _data(shape=(tokens,), vocab=vocab, dtype=torch.bfloat16)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    leaf = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_loss(leaf, labels, chunk_size=16)
    big = [s for s in saved if len(s[1]) == 2]
    assert big == [(torch.bfloat16, (tokens, vocab))], saved
    assert all(len(shape) <= 1 and (not shape or shape[0] == tokens) for _, shape in saved if len(shape) != 2)
    loss.backward()
    assert leaf.grad.dtype == torch.bfloat16


def test_peak_memory_chunked_vs_unchunked(capsys):
    """Measures (prints, does not assert: allocator details vary) the forward+backward peak on CPU."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    tokens, vocab = 2048, 8192
    logits, labels = _data(shape=(tokens,), vocab=vocab, dtype=torch.bfloat16)
    leaf = logits.requires_grad_()
    peaks = {}
    for chunk_size in (None, 256):
        leaf.grad = None
        tracker = mem_tracker.MemTracker()
        with tracker:
            cross_entropy_loss(leaf, labels, chunk_size=chunk_size).backward()
        peaks[chunk_size] = tracker.get_tracker_snapshot("peak")[leaf.device]["Total"]
    with capsys.disabled():
        print(
            f"\n[loss peak] tokens={tokens} vocab={vocab} bf16 logits={leaf.numel() * 2 / 2**20:.0f} MiB: "
            f"unchunked {peaks[None] / 2**20:.0f} MiB, chunk_size=256 {peaks[256] / 2**20:.0f} MiB"
        )
    assert peaks[None] > 0 and peaks[256] > 0


def test_rejects_bad_arguments():
    logits, labels = _data()
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_loss(logits, labels, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        cross_entropy_loss(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match="shape"):
        cross_entropy_loss(logits, labels[:, :-1])
    with pytest.raises(TypeError, match="labels"):
        cross_entropy_loss(logits, labels.double())
