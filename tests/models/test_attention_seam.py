"""The attention seam's sliding window and attention sinks (titanlike.models.masking / decoder.AttentionCore):

* the window's convention is transformers' (``sliding_window_causal_mask_function``, the mask gpt-oss / Mistral /
  Qwen2 use), composed with block_causal (a window never crosses a document start);
* the exact path (SDPA with a boolean mask; sinks by an explicit softmax) equals transformers' own eager gpt-oss
  attention (``eager_attention_forward``, sinks included) and a brute-force per-row reference in float64: outputs and
  the gradients of q, k, v and the sinks;
* FlexAttention (the CUDA path) on CPU: its eager reference with sinks from its log-sum-exp, and the compiled kernel
  (float32 only, forward only, no log-sum-exp on CPU in torch 2.13) for the window and block-causal masks, against
  the exact path; the existing block-causal compiled path included.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

from titanlike.models.decoder import AttentionCore
from titanlike.models.masking import DocumentMask, attention_with_sinks, document_starts, window_keys

TOL = 1e-12
B, H, KV, S, D = 2, 4, 2, 24, 8


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, dtype=dtype, generator=g)
    k = torch.randn(B, S, KV, D, dtype=dtype, generator=g)
    v = torch.randn(B, S, KV, D, dtype=dtype, generator=g)
    sinks = torch.randn(H, dtype=dtype, generator=g)
    return q, k, v, sinks


def _starts():
    x = torch.ones(B, S, dtype=torch.int64)
    x[0, [4, 11, 12]] = 0
    x[1, 17] = 0
    return document_starts(x, 0)


def _brute(q, k, v, window=None, sinks=None, starts=None):
    """Row by row: query i's visible keys, their softmax (with the sink's exp in the denominator)."""
    rep = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(q.shape[1]):
                lo = 0 if starts is None else int(starts[b, i])
                if window is not None:
                    lo = max(lo, i - window + 1)
                s = k[b, lo : i + 1, h // rep] @ q[b, i, h] / D**0.5
                z = torch.cat([s, sinks[h : h + 1]]) if sinks is not None else s
                p = z.softmax(0)[: s.shape[0]]
                out[b, i, h] = p @ v[b, lo : i + 1, h // rep]
    return out


def test_window_convention_is_transformers():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    for w in (1, 3, 8, S, S + 5):
        theirs = sdpa_mask(1, S, S, mask_function=sliding_window_causal_mask_function(w), allow_is_causal_skip=False)
        ours = DocumentMask.causal(1, torch.arange(S)).dense(0, S, S, window=w)
        assert torch.equal(theirs, ours), w
        assert ours[0, 0].sum(-1).max().item() == min(w, S)  # at most w keys, the query itself included
    assert window_keys(10, 15, 4) == (7, 16) and window_keys(2, 5, 8) == (0, 6) and window_keys(3, 9, None) == (0, 10)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_exact_path_equals_brute_force(window, with_sinks, documents):
    q, k, v, sinks = _qkv()
    params = [t.requires_grad_() for t in (q, k, v, sinks)]
    starts = _starts() if documents else None
    mask = DocumentMask(starts, torch.arange(S), windows=(window,)) if documents else None
    core = AttentionCore(window=window, sinks=with_sinks)
    out = core(q, k, v, mask, sinks=sinks if with_sinks else None)
    ref = _brute(q, k, v, window, sinks if with_sinks else None, starts)
    assert (out - ref).abs().max().item() <= TOL
    w = torch.randn_like(out)
    g = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    gr = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for a, b in zip(g, gr):
        assert (a is None) == (b is None) and (a is None or (a - b).abs().max().item() <= TOL)
    if with_sinks:
        assert g[3].abs().max().item() > 1e-3  # the sink parameter gets its gradient
    if window is not None and window < S:  # the window acts
        assert (out - _brute(q, k, v, None, sinks if with_sinks else None, starts)).abs().max().item() > 1e-3


def test_sinks_equal_transformers_eager_gpt_oss():
    """transformers' own gpt-oss attention (eager_attention_forward with the module's sinks, the sliding-window
    mask of masking_utils as an additive mask) against the seam, float64, values and gradients."""
    from types import SimpleNamespace

    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = _qkv()
    params = [t.requires_grad_() for t in (q, k, v, sinks)]
    for window in (None, 6):
        fn = sliding_window_causal_mask_function(window) if window else None
        kw = {"mask_function": fn} if fn else {}
        keep = sdpa_mask(B, S, S, allow_is_causal_skip=False, **kw)
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        module = SimpleNamespace(num_key_value_groups=H // KV, sinks=sinks, training=False)
        theirs, _ = eager_attention_forward(
            module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive, scaling=D**-0.5
        )
        ours = AttentionCore(window=window, sinks=True)(q, k, v, sinks=sinks)
        assert (ours - theirs).abs().max().item() <= TOL
        w = torch.randn_like(ours)
        g = torch.autograd.grad((ours * w).sum(), params)
        gt = torch.autograd.grad((theirs * w).sum(), params)
        assert max((a - b).abs().max().item() for a, b in zip(g, gt)) <= TOL


def _flex_mask(mask: DocumentMask) -> DocumentMask:
    return DocumentMask(mask.starts, mask.positions, backend="flex", windows=mask.windows, documents=mask.documents)


def _exp(t):  # (batch, seq, heads, d) -> (batch, heads, seq, d) with kv heads repeated
    return t.repeat_interleave(H // t.shape[2], dim=2).transpose(1, 2)


@pytest.mark.parametrize("documents", [False, True])
def test_flex_reference_with_sinks_equals_exact(documents):
    """FlexAttention's eager CPU reference (the CUDA path's masks and its log-sum-exp sinks), float64, with rows and
    a key range as context parallelism calls it."""
    q, k, v, sinks = _qkv()
    q, k, v = _exp(q), _exp(k), _exp(v)
    for window in (None, 5):
        pos = torch.arange(S)
        exact = (
            DocumentMask(_starts(), pos, windows=(window,))
            if documents
            else DocumentMask.causal(B, pos, windows=(window,))
        )
        flex = _flex_mask(exact)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex warns that it is not compiled (its unfused reference)
            for s in (None, sinks):
                a = exact.attend(q, k, v, window=window, sinks=s)
                b = flex.attend(q, k, v, window=window, sinks=s)
                assert (a - b).abs().max().item() <= TOL
                k0, k1 = window_keys(12, 17, window)  # rows 12..17 against the keys they can see
                args = (q[:, :, 12:18], k[:, :, k0:k1], v[:, :, k0:k1], (12, 18))
                a = exact.attend(*args, window=window, sinks=s, key_start=k0)
                b = flex.attend(*args, window=window, sinks=s, key_start=k0)
                assert (a - b).abs().max().item() <= TOL


def test_flex_compiled_forward_equals_exact():
    """The compiled FlexAttention kernel itself (``masking._flex`` as CUDA takes it; on CPU torch 2.13 compiles it in
    float32, forward only, without log-sum-exp): block-causal (the existing path, never run before), a sliding window,
    both, and the causal mask of a windowed model, each against the exact path in float32."""
    import titanlike.models.masking as masking

    q, k, v, _ = _qkv(torch.float32)
    q, k, v = _exp(q), _exp(k), _exp(v)
    pos = torch.arange(S)
    cases = [(DocumentMask(_starts(), pos), None), (DocumentMask(_starts(), pos, windows=(5,)), 5)]
    cases.append((DocumentMask.causal(B, pos, windows=(5, None)), 5))
    with torch.no_grad():
        for exact, window in cases:
            mask = _flex_mask(exact)._mask_for(0, S, S, B, q.device, window, 0)
            out = masking._flex(q, k, v, mask, compiled=True)
            ref = exact.attend(q, k, v, window=window)
            assert (out - ref).abs().max().item() <= 1e-5
            assert (out - exact.attend(q, k, v)).abs().max().item() > 1e-3 or window is None


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be >= 1"):
        AttentionCore(window=0)


def test_sinks_formula_by_lse_identity():
    """The log-sum-exp identity the flex path uses, checked on the exact scores."""
    from titanlike.models.masking import _sinks_from_lse

    q, k, v, sinks = _qkv()
    q, k, v = _exp(q), _exp(k), _exp(v)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    scores = ((q @ k.transpose(-2, -1)) / D**0.5).masked_fill(~keep, float("-inf"))
    plain = scores.softmax(-1) @ v
    got = _sinks_from_lse(plain, scores.logsumexp(-1), sinks)
    assert (got - attention_with_sinks(q, k, v, keep, sinks)).abs().max().item() <= TOL


def _repeat_reference(core, q, k, v, mask, sinks):
    """The seam as it was: k and v repeated to every query head, then the same attention (no grouped heads)."""
    n_rep = q.shape[2] // k.shape[2]
    return core(q, k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2), mask, sinks=sinks)


def _ops(fn):
    """The aten ops ``fn`` runs (forward and backward), by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


GQA_CASES = [
    ("causal", "sdpa"),  # no mask: SDPA's causal fast path, on every device
    *[(c, b) for b in ("sdpa", "flex") for c in ("block_causal", "window", "sinks", "window_sinks_documents")],
]


@pytest.mark.parametrize("case,backend", GQA_CASES, ids=[f"{c}-{b}" for c, b in GQA_CASES])
def test_grouped_query_heads_through_enable_gqa_equal_the_repeat(case, backend, monkeypatch):
    """Grouped-query attention reads k and v in place (SDPA's / FlexAttention's ``enable_gqa``) under every mask the
    seam uses, equal in float64 to repeating them to every query head: outputs, and on the exact (SDPA) path the
    gradients of q, k, v and the sinks (FlexAttention has no backward on CPU). Only the explicit sinks path (its
    scores cost more than the repeat) still repeats; elsewhere no op copies k or v."""
    q, k, v, sinks = _qkv()
    window = 5 if "window" in case else None
    with_sinks = "sinks" in case
    core = AttentionCore(window=window, sinks=with_sinks)
    positions = torch.arange(S)
    if case == "causal":
        mask = None
    elif case in ("block_causal", "window_sinks_documents"):
        mask = DocumentMask(_starts(), positions, backend=backend, windows=(window,))
    else:
        mask = DocumentMask.causal(B, positions, (window,), backend=backend)
    grad = backend == "sdpa"
    outs, grads = [], []
    for fn in (core, partial(_repeat_reference, core)):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v, sinks)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex's eager reference warns that it is not compiled
            out = fn(*leaves[:3], mask, sinks=leaves[3] if with_sinks else None)
        if grad:
            out.square().sum().backward()
            grads.append([t.grad for t in leaves[: 4 if with_sinks else 3]])
        outs.append(out.detach())
    assert (outs[0] - outs[1]).abs().max() <= TOL
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= TOL
    repeats = []
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(
        torch.Tensor, "repeat_interleave", lambda t, *a, **kw: repeats.append(t.shape) or real(t, *a, **kw)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core(q, k, v, mask, sinks=sinks if with_sinks else None)
    assert bool(repeats) == (with_sinks and backend == "sdpa"), repeats
    if backend == "sdpa" and not with_sinks:  # the ops SDPA runs: none copies k or v to every query head
        ops = _ops(lambda: core(q, k, v, mask))
        assert not {"repeat_interleave", "expand", "clone", "repeat"} & set(ops), ops
