"""The plain model: shapes, causality, initialisation, meta-device build, partial stages, tied embeddings."""

import ast
from pathlib import Path

import pytest
import torch

from titanlike.models import FLAVORS, ModelArgs, Transformer
from titanlike.models.llama import apply_rope, rope_tables

ARGS = FLAVORS["tiny"].replace(vocab_size=96)


def build(args=ARGS, seed=0):
    torch.manual_seed(seed)
    m = Transformer(args)
    m.init_weights()
    return m


def test_shapes_and_param_count():
    m = build()
    x = torch.randint(0, 96, (3, 20))
    assert m(x).shape == (3, 20, 96)
    assert sum(p.numel() for p in m.parameters()) == ARGS.num_params()
    tied = build(ARGS.replace(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert sum(p.numel() for p in tied.parameters()) == ARGS.replace(tie_embeddings=True).num_params()


def test_causality_future_tokens_never_change_earlier_logits():
    m = build().double()
    x = torch.randint(0, 96, (2, 24))
    ref = m(x)
    for t in (0, 7, 23):
        y = x.clone()
        y[:, t:] = torch.randint(0, 96, y[:, t:].shape)
        out = m(y)
        assert torch.equal(out[:, :t], ref[:, :t])
        if t < 23:
            assert not torch.allclose(out[:, t:], ref[:, t:])


def test_init_is_seeded_and_sane():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if "norm" not in n:
            assert not torch.equal(p, r), n
    assert torch.equal(a.layers["0"].attention_norm.weight, torch.ones(ARGS.dim))
    wq = a.layers["0"].attention.wq.weight
    assert 0.015 < wq.std() < 0.025
    # residual-writing projections are depth-scaled
    assert a.layers["1"].attention.wo.weight.std() < a.layers["0"].attention.wo.weight.std() * 0.9


def test_meta_build_then_materialise_equals_eager_init():
    eager = Transformer(ARGS)
    torch.manual_seed(3)
    eager.init_weights()
    with torch.device("meta"):
        lazy = Transformer(ARGS)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights(buffer_device=torch.device("cpu"))
    x = torch.randint(0, 96, (2, 10))
    torch.testing.assert_close(lazy(x), eager(x), rtol=0, atol=0)


def test_405b_builds_on_meta_without_memory():
    with torch.device("meta"):
        m = Transformer(FLAVORS["405B"])
    assert sum(p.numel() for p in m.parameters()) == FLAVORS["405B"].num_params()
    assert abs(FLAVORS["405B"].num_params() / 1e9 - 405.85) < 0.01


def test_pipeline_stages_compose_to_the_full_model_and_keep_names():
    """The one stage builder (the model with the other stage's modules removed): full-model FQNs, copies of the
    values, and the forward skips what a stage lacks (hidden states in, hidden states out)."""
    from titanlike.parallel.pipeline import build_stage

    full = build().double()
    x = torch.randint(0, 96, (2, 12))
    first = build_stage(full, ["tok_embeddings", "layers.0"])
    last = build_stage(full, ["layers.1", "norm", "output"])
    sd = full.state_dict()
    assert first.output is None and last.tok_embeddings is None and list(last.layers) == ["1"]
    assert set(first.state_dict()) | set(last.state_dict()) == set(sd)
    assert "layers.1.attention.wq.weight" in last.state_dict()
    assert last.rope_cos.shape == full.rope_cos.shape  # root buffers (RoPE tables) on every stage
    assert torch.equal(last(first(x)), full(x))


def test_rope_matches_complex_rotation():
    cos, sin = rope_tables(8, 16, 10000.0)
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    out = apply_rope(x, cos, sin)
    xc = torch.view_as_complex(x.reshape(2, 16, 3, 4, 2))
    rot = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None, :]
    ref = torch.view_as_real(xc * rot).flatten(-2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_gqa_equals_explicitly_repeated_heads():
    args = ARGS.replace(n_heads=4, n_kv_heads=1)
    m = build(args).double()
    attn = m.layers["0"].attention
    full = Transformer(args.replace(n_kv_heads=4)).double()
    fa = full.layers["0"].attention
    with torch.no_grad():
        fa.wq.weight.copy_(attn.wq.weight)
        fa.wo.weight.copy_(attn.wo.weight)
        fa.wk.weight.copy_(attn.wk.weight.repeat(4, 1))
        fa.wv.weight.copy_(attn.wv.weight.repeat(4, 1))
    x = torch.randn(2, 8, args.dim, dtype=torch.float64)
    cos, sin = m.rope_cos, m.rope_sin
    torch.testing.assert_close(attn(x, cos=cos, sin=sin), fa(x, cos=cos, sin=sin), rtol=0, atol=1e-12)


def test_vocab_must_be_set():
    with pytest.raises(ValueError, match="vocab_size is not set"):
        Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2))


def test_model_package_never_imports_torch_distributed():
    """Every file of every model folder, and the sharding vocabulary the models declare their layout in."""
    root = Path(__file__).resolve().parents[2] / "titanlike"
    paths = [*root.joinpath("models").rglob("*.py"), root / "sharding.py"]
    assert len(paths) > 8
    for path in paths:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(n.startswith("torch.distributed") or n.startswith("titanlike.parallel") for n in names), path


@pytest.mark.parametrize("tie", [False, True])
def test_initial_loss_is_near_uniform(tie):
    """At init the model should be close to a uniform guess (ln V), tied or not (a tied table that is too large
    makes every token predict itself)."""
    from titanlike.loss import cross_entropy_loss

    args = FLAVORS["debugmodel"].replace(vocab_size=2048, tie_embeddings=tie)
    m = build(args)
    x = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = float(cross_entropy_loss(m(x)[:, :-1], x[:, 1:], reduction="mean"))
    assert abs(loss - torch.log(torch.tensor(2048.0)).item()) < 0.75, loss
