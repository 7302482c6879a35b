"""The sharding vocabulary (titanlike/sharding.py) and every registered model's declaration: plain data that matches
the model's modules, from which the planner's dims and float8's eligible Linears are read."""

import pytest
import torch

from titanlike.models import get_spec, registered
from titanlike.sharding import (
    Colwise,
    FusedColwise,
    Head,
    HeadNorm,
    Norm,
    Rowwise,
    check_sharding,
    entry_for,
    float8_patterns,
    matches,
    param_dims,
)


def _tiny_args(spec):
    """The tiny args of a registered model: its "tiny" flavor, or (a model without flavors: the transformers one) a
    small config of its kind."""
    if spec.flavors:
        return spec.flavors["tiny"].replace(vocab_size=64)
    from hf_models import hf_folder

    from titanlike.models.transformers_lm import args_from_folder

    return args_from_folder(hf_folder("hf_phi3"))


@pytest.mark.parametrize("name", registered())
def test_every_pattern_matches_modules_and_no_module_two_patterns(name):
    spec = get_spec(name)
    args = _tiny_args(spec)
    model = spec.build_meta(args)
    sharding = spec.sharding_of(args)
    assert check_sharding(sharding, [n for n, _ in model.named_modules()]) == []
    # every parameter's dims are those of a dim it has
    for fqn, p in model.named_parameters():
        d, fd = param_dims(sharding, fqn, p.ndim, tp=2, fsdp=True)
        assert (d is None or d < p.ndim) and fd < p.ndim, fqn


def test_the_vocabulary_reads_as_the_styles_shard():
    s = {"layers.*.attn.qkv": FusedColwise(3), "layers.*.wo": Rowwise(), "layers.*.q_norm": HeadNorm(), "out": Head()}
    assert matches("layers.*.wo", "layers.3.wo") and not matches("layers.*.wo", "layers.3.attn.wo")
    assert isinstance(entry_for(s, "layers.0.q_norm"), HeadNorm) and entry_for(s, "norm") is None
    assert param_dims(s, "layers.0.wo.weight", 2, tp=2, fsdp=True) == (1, 0)
    assert param_dims(s, "layers.0.wo.bias", 1, tp=2, fsdp=True) == (None, 0)
    assert param_dims(s, "layers.0.wo.weight", 2, tp=1, fsdp=True) == (None, 0)  # no tensor parallelism
    assert param_dims(s, "layers.0.attn.qkv.weight", 2, tp=2, fsdp=True) == (0, 1)  # chunk-sharded: FSDP on dim 1
    assert param_dims(s, "layers.0.attn.qkv.bias", 1, tp=2, fsdp=True) == (None, 0)  # replicated once FSDP shards
    assert param_dims(s, "layers.0.attn.qkv.bias", 1, tp=2, fsdp=False) == (0, 0)
    assert param_dims({"x": FusedColwise((2, 1, 1))}, "x.weight", 2, tp=2, fsdp=True) == (None, 0)  # unequal
    assert param_dims(s, "layers.0.q_norm.weight", 1, tp=2, fsdp=True) == (None, 0)
    assert FusedColwise((2, 1, 1)).sizes(64) == [32, 16, 16]
    with pytest.raises(ValueError, match="do not split in proportion"):
        FusedColwise((2, 1, 1)).sizes(30)
    assert float8_patterns({"a": Colwise(), "b": Colwise(float8=False), "c": Norm()}) == ("a",)
    assert check_sharding({"nothing.*": Norm()}, ["a", "a.b"]) == ["sharding pattern 'nothing.*' matches no module"]


def test_float8_eligibility_is_declared_by_each_model():
    for name, expected in (("llama3", 7), ("qwen3", 7), ("gpt2", 0)):
        patterns = float8_patterns(get_spec(name).sharding)
        assert len(patterns) == expected, (name, patterns)
    spec = get_spec("qwen3")
    model = spec.build_meta(spec.flavors["tiny"].replace(vocab_size=64))
    eligible = [n for n, m in model.named_modules() if any(matches(p, n) for p in float8_patterns(spec.sharding))]
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in eligible) and len(eligible) == 2 * 7
