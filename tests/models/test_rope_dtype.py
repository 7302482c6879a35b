"""RoPE tables follow the run's precision: float64 in a float64 model (built as the trainer builds it, on meta under
the float64 default dtype, then materialised; or ``.double()`` then ``init_weights``), float32 otherwise. A float64
model's forward equals the real transformers implementation in float64, which float32 tables do not.

transformers computes two things in float32 even in a float64 model (transformers 5): its rotary angles
(``inv_freq`` and the ``autocast``-off float32 product in ``LlamaRotaryEmbedding.forward``) and its RMSNorms (they
cast to float32 and back): 4e-7 off any float64 computation. The reference keeps every other transformers module
(attention, GQA, rotate_half, MLP, weight layout) and replaces those two by their formulas in float64; transformers'
inverse frequencies are checked against ours to float32 rounding."""

import pytest
import torch
import transformers  # the [hf] extra, installed by CI: a missing one fails, never skips

from titanlike.hf import hf_config, to_hf
from titanlike.models import get_spec
from titanlike.models.layers import rope_inv_freq, rope_tables
from titanlike.parallel.materialize import materialize

CASES = {
    # Llama with llama3 RoPE scaling (the scaled inverse frequencies too), Qwen3 (its half-split rotation)
    "llama3": dict(max_seq_len=512, rope_scaling="llama3", rope_original_max_seq_len=64, vocab_size=96),
    "qwen3": dict(max_seq_len=512, vocab_size=96),
}


def _build(name: str, dtype: torch.dtype):
    spec = get_spec(name)
    args = spec.flavors["tiny"].replace(**CASES[name])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = spec.build(args)
    finally:
        torch.set_default_dtype(prev)
    materialize(model, torch.device("cpu"), seed=0)
    return model, args


@pytest.mark.parametrize("name", list(CASES))
def test_tables_in_the_models_precision(name):
    for dtype, want in (
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ):
        model, args = _build(name, dtype)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args)
        assert model.rope_cos.dtype == model.rope_sin.dtype == want, (dtype, model.rope_cos.dtype)
        assert torch.equal(model.rope_cos, cos.to(want)) and torch.equal(model.rope_sin, sin.to(want))
    # a float32 model cast with .double(): init_weights recomputes the tables in float64 (not float32 values cast)
    model, args = _build(name, torch.float32)
    model = model.double()
    model.init_weights(seed=0)
    assert torch.equal(model.rope_cos, rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args)[0])


class _Float64Rotary(torch.nn.Module):
    """transformers' rotary embedding interface ((cos, sin) of (batch, seq, head_dim), halves repeated) from the
    float64 tables."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def forward(self, x, position_ids):
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def _float64_rms_norm(norm):
    def forward(x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    return forward


@pytest.mark.parametrize("name", list(CASES))
def test_float64_forward_equals_transformers_in_float64(name):
    model, args = _build(name, torch.float64)
    model.eval()
    config = hf_config(args, torch.float64)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float64
    ).eval()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(to_hf(sd, args), strict=False)
    assert not unexpected and all("rotary" in k or "lm_head" in k for k in missing), (missing, unexpected)
    theirs = hf.model.rotary_emb.inv_freq
    ours = rope_inv_freq(args.head_dim, args.rope_theta, args)
    assert torch.allclose(theirs.double(), ours, rtol=1e-6, atol=0), (theirs, ours)  # the same scaled frequencies
    for m in hf.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = _float64_rms_norm(m)
    hf.model.rotary_emb = _Float64Rotary(*rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args))
    x = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(x).logits
        diff = (model(x) - ref).abs().max().item()
        # the test can fail: the same model with float32 tables (what a float64 run had before) is far off
        model.rope_cos, model.rope_sin = model.rope_cos.float().double(), model.rope_sin.float().double()
        f32_diff = (model(x) - ref).abs().max().item()
    assert diff < 1e-13, diff  # measured 9e-16 (Llama with llama3 scaling) on 512 positions
    assert f32_diff > 1e-12 and f32_diff > 1000 * diff, (f32_diff, diff)  # measured 7e-12
