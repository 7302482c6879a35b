"""GPT-2: the real architecture (parameter counts of the published sizes), causality, partial stages with full-model
FQNs, and Hugging Face GPT2LMHeadModel interop (names, Conv1D transposes, the same logits)."""

import pytest
import torch

from titanlike.hf import from_hf, hf_config, model_args_from_hf_config, to_hf
from titanlike.models import get_spec
from titanlike.models.gpt2 import FLAVORS, GPT2

SPEC = get_spec("gpt2")
ARGS = FLAVORS["tiny"].replace(vocab_size=96, max_seq_len=32)


def build(args=ARGS, seed=0):
    torch.manual_seed(seed)
    m = GPT2(args)
    m.init_weights()
    return m


@pytest.mark.parametrize(
    "flavor,count", [("124M", 124_439_808), ("350M", 354_823_168), ("774M", 774_030_080), ("1.5B", 1_557_611_200)]
)
def test_published_parameter_counts(flavor, count):
    args = FLAVORS[flavor]  # vocab 50,257, 1,024 positions, tied: the published GPT-2 sizes
    assert args.num_params() == count
    assert sum(p.numel() for p in SPEC.build_meta(args).parameters()) == count


def test_forward_causal_tied_and_flops():
    m = build().double()
    x = torch.randint(0, 96, (2, 20))
    ref = m(x)
    assert ref.shape == (2, 20, 96) and m.output.weight is m.tok_embeddings.weight
    y = x.clone()
    y[:, 9:] = 0
    assert torch.equal(m(y)[:, :9], ref[:, :9])
    d, h, L, V, s = ARGS.dim, ARGS.hidden_dim, ARGS.n_layers, ARGS.vocab_size, 20
    assert SPEC.flops_per_token(ARGS, s) == 6 * (L * (4 * d * d + 2 * d * h) + V * d) + 12 * L * d * s


def test_stages_keep_full_model_names_and_compose():
    full = build().double()
    names = [["tok_embeddings", "pos_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    from titanlike.parallel.pipeline import build_stage

    stages = [build_stage(full, n) for n in names]
    assert "layers.1.attn.c_attn.weight" in dict(stages[1].named_parameters())
    assert stages[0].norm is None and stages[1].tok_embeddings is None
    x = torch.randint(0, 96, (2, 12))
    assert torch.equal(stages[1](stages[0](x)), full(x))


def test_hf_names_and_transposes_roundtrip():
    m = build()
    hf = to_hf(m.state_dict(), ARGS)
    assert "lm_head.weight" not in hf  # tied
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (ARGS.dim, 3 * ARGS.dim)
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], m.layers["1"].mlp.c_fc.weight.t())
    back = from_hf(hf, ARGS)
    assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())
    assert model_args_from_hf_config(hf_config(ARGS)) == ARGS
    with pytest.raises(ValueError, match="the file lacks transformer.h.1.ln_2.bias"):
        from_hf({k: v for k, v in hf.items() if k != "transformer.h.1.ln_2.bias"}, ARGS)


def test_logits_equal_transformers_gpt2lmheadmodel():
    import transformers  # the [hf] extra, installed by CI (.[test,hf,float8]): a missing one fails, never skips

    config = transformers.GPT2Config(**{k: v for k, v in hf_config(ARGS).items() if k != "torch_dtype"})
    torch.manual_seed(1)
    theirs = transformers.GPT2LMHeadModel(config).double().eval()
    args = model_args_from_hf_config(config.to_dict())
    ours = GPT2(args).double()
    ours.load_state_dict(from_hf(theirs.state_dict(), args))
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() < 1e-12
    # ... and the other way: our weights into their model.
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict(), args), strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith(".attn.bias") for k in missing)
