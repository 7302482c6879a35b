"""Qwen3, the model added as one folder (titanlike/models/qwen3/) plus one registry line: the published shapes,
QK-norm, the explicit head_dim, tied embeddings for the small sizes, pipeline stages from the one stage builder, and
the logits of transformers' own Qwen3ForCausalLM. (Layouts: the float64 gates; HF folders: test_hf_qwen3.py.)"""

import pytest
import torch

from titanlike.hf import from_hf, hf_config, model_args_from_hf_config, to_hf
from titanlike.models import get_spec
from titanlike.models.qwen3 import FLAVORS, Qwen3
from titanlike.parallel.pipeline import build_stage

SPEC = get_spec("qwen3")
ARGS = FLAVORS["tiny"].replace(vocab_size=96, dim=64, max_seq_len=32)  # q: 4 heads x 32 = 128 wide, dim 64


def build(args=ARGS, seed=0):
    m = Qwen3(args)
    m.init_weights(seed=seed)
    return m


# (flavor, layers, dim, heads, kv heads, SwiGLU width, tied, parameters): Qwen's model cards / config.json
PUBLISHED = [
    ("0.6B", 28, 1024, 16, 8, 3072, True, 596_049_920),
    ("1.7B", 28, 2048, 16, 8, 6144, True, 1_720_574_976),
    ("8B", 36, 4096, 32, 8, 12288, False, 8_190_735_360),
    ("32B", 64, 5120, 64, 8, 25600, False, 32_762_123_264),
]


@pytest.mark.parametrize("flavor,layers,dim,heads,kv,ffn,tied,count", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_shapes(flavor, layers, dim, heads, kv, ffn, tied, count):
    a = FLAVORS[flavor]
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.hidden_dim, a.tie_embeddings) == (
        layers,
        dim,
        heads,
        kv,
        ffn,
        tied,
    )
    assert (a.head_dim, a.vocab_size, a.rope_theta, a.norm_eps, a.max_seq_len) == (128, 151936, 1e6, 1e-6, 40960)
    assert a.num_params() == count == sum(p.numel() for p in SPEC.build_meta(a).parameters())


def test_forward_is_causal_tied_and_has_qk_norm():
    m = build().double()
    assert m.output.weight is m.tok_embeddings.weight  # tied, as the small sizes
    attn = m.layers["0"].attention
    assert attn.wq.weight.shape == (128, 64) and attn.q_norm.weight.shape == attn.k_norm.weight.shape == (32,)
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())
    x = torch.randint(0, 96, (2, 20))
    ref = m(x)
    y = x.clone()
    y[:, 9:] = 0
    assert torch.equal(m(y)[:, :9], ref[:, :9])


def test_stages_keep_full_model_names_and_compose():
    full = build().double()
    stages = [build_stage(full, ["tok_embeddings", "layers.0"]), build_stage(full, ["layers.1", "norm", "output"])]
    assert "layers.1.attention.q_norm.weight" in dict(stages[1].named_parameters())
    assert stages[0].norm is None and stages[1].tok_embeddings is None
    x = torch.randint(0, 96, (2, 12))
    assert torch.equal(stages[1](stages[0](x)), full(x))


def test_logits_equal_transformers_qwen3forcausallm_both_ways():
    import transformers  # the [hf] extra, installed by CI (.[test,hf,float8]): a missing one fails, never skips

    for tied in (True, False):
        args = ARGS.replace(tie_embeddings=tied)
        config = transformers.Qwen3Config(**{k: v for k, v in hf_config(args).items() if k not in ("dtype",)})
        torch.manual_seed(1)
        theirs = transformers.Qwen3ForCausalLM(config).double().eval()
        with torch.no_grad():  # non-trivial norms, q/k norms included, so that a swapped norm shows
            for n, p in theirs.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))
        assert model_args_from_hf_config(config.to_dict()) == args
        ours = Qwen3(args).double()
        ours.init_buffers()
        ours.load_state_dict(from_hf(theirs.state_dict(), args))
        x = torch.randint(0, 96, (2, 16))
        with torch.no_grad():
            # transformers computes the RoPE angles in float32, titanlike in float64
            assert (theirs(x).logits - ours(x)).abs().max().item() < 1e-6
        missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict(), args), strict=False)
        assert not unexpected and missing == (["lm_head.weight"] if tied else [])


def test_config_json_fields_it_cannot_honour_are_refused_together():
    bad = {
        **hf_config(ARGS),
        "use_sliding_window": True,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(bad)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("use_sliding_window = True", "attention_bias = True", "rope type 'yarn'", "rope_parameters factor"):
        assert part in msg, msg
