"""The TE converter's logic, exercised with a stand-in namespace that mimics Transformer Engine's classes
(constructor signatures, parameter names, ``_extra_state``, the autocast context). The real TE kernels only
run on CUDA with TE installed; here we check what the converter does with the model.
"""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titanlike.kernels import (
    TEUnavailableError,
    convert_kernels,
    convert_to_te,
    load_te,
    make_fp8_recipe,
    te_available,
    te_to_torch_state_dict,
    torch_to_te_state_dict,
)
from titanlike.models.llama import FLAVORS, Transformer

_ACTIVE_RECIPE: list = []  # the stand-in autocast's state


class _TEModuleBase(nn.Module):
    """Like TE's TransformerEngineBaseModule: FP8 metadata travels as ``_extra_state`` (a uint8 tensor)."""

    def get_extra_state(self):
        return torch.tensor(list(b"fp8-meta"), dtype=torch.uint8)

    def set_extra_state(self, state):
        assert state is None or state.dtype == torch.uint8

    def _record(self):
        self.seen_recipes = getattr(self, "seen_recipes", []) + [_ACTIVE_RECIPE[-1] if _ACTIVE_RECIPE else None]


class StandInLinear(_TEModuleBase):
    def __init__(
        self,
        in_features,
        out_features,
        sequence_parallel=False,
        fuse_wgrad_accumulation=False,
        tp_group=None,
        tp_size=1,
        get_rng_state_tracker=None,
        rng_tracker_name=None,
        init_method=None,
        bias=True,
        return_bias=False,
        params_dtype=None,
        parallel_mode=None,
        parameters_split=None,
        device="cuda",
        **kwargs,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, inp, is_first_microbatch=None):
        self._record()
        return F.linear(inp, self.weight, self.bias)


class StandInRMSNorm(_TEModuleBase):
    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        sequence_parallel=None,
        params_dtype=None,
        zero_centered_gamma=False,
        device="cuda",
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(normalized_shape, dtype=params_dtype or torch.get_default_dtype(), device=device)
        )

    def reset_parameters(self, defer_init=None):
        nn.init.ones_(self.weight)

    def forward(self, x):
        self._record()
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _recipe_class(name):
    return type(name, (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)})


@contextlib.contextmanager
def _autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    _ACTIVE_RECIPE.append(recipe)
    try:
        yield
    finally:
        _ACTIVE_RECIPE.pop()


def _standin(new_api=True):
    recipe = types.SimpleNamespace(
        **{
            n: _recipe_class(n)
            for n in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
        }
    )
    legacy = None
    if not new_api:

        def legacy(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
            return _autocast(enabled, calibrating, fp8_recipe, fp8_group)

    return types.SimpleNamespace(
        Linear=StandInLinear,
        RMSNorm=StandInRMSNorm,
        autocast=_autocast if new_api else None,
        fp8_autocast=legacy,
        recipe=recipe,
    )


def _model(dtype=torch.float64, **shape):
    torch.manual_seed(0)
    model = Transformer(FLAVORS["tiny"].replace(vocab_size=64, **shape)).to(dtype)
    model.init_weights()
    return model


def _loss_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_conversion_keeps_names_shapes_values_and_numerics():
    ref = _model()
    model = convert_to_te(copy.deepcopy(ref), te=_standin())
    block = model.layers["0"]
    assert isinstance(block.attention_norm, StandInRMSNorm) and isinstance(block.ffn_norm, StandInRMSNorm)
    assert all(isinstance(getattr(block.attention, n), StandInLinear) for n in ("wq", "wk", "wv", "wo"))
    assert all(isinstance(getattr(block.feed_forward, n), StandInLinear) for n in ("w1", "w2", "w3"))
    assert isinstance(model.norm, StandInRMSNorm)
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding  # kept in torch
    assert len(model._te_converted) == 2 * 9 + 1

    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    assert list(params) == list(ref_params)
    for n, p in params.items():
        assert p.shape == ref_params[n].shape and p.dtype == ref_params[n].dtype and torch.equal(p, ref_params[n])

    tokens = torch.randint(0, 64, (2, 9))
    ref_loss, ref_grads = _loss_grads(ref, tokens)
    loss, grads = _loss_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert block.attention.wq.seen_recipes == [None]  # no FP8 recipe: no autocast


def test_qwen3_converts_through_its_spec_with_its_per_head_norms():
    """The spec declares the swappable norm (ModelSpec.te_norm), not the converter: Qwen3's blocks get TE Linears and
    RMSNorms, its per-head q / k norms included, names and numerics unchanged; GPT-2 declares none and is refused."""
    from titanlike.models import get_spec

    spec = get_spec("qwen3")
    torch.manual_seed(0)
    ref = spec.build(spec.flavors["tiny"].replace(vocab_size=64)).double()
    ref.init_weights()
    model = convert_to_te(copy.deepcopy(ref), te=_standin())
    attn = model.layers["0"].attention
    assert isinstance(attn.q_norm, StandInRMSNorm) and isinstance(attn.k_norm, StandInRMSNorm)
    assert len(model._te_converted) == 2 * 11 + 1 and list(dict(model.named_parameters())) == list(
        dict(ref.named_parameters())
    )
    tokens = torch.randint(0, 64, (2, 9))
    assert torch.equal(_loss_grads(model, tokens)[0], _loss_grads(ref, tokens)[0])
    gpt2 = get_spec("gpt2")
    with pytest.raises(ValueError, match="declares no Transformer Engine swap"):
        convert_to_te(gpt2.build_meta(gpt2.flavors["tiny"].replace(vocab_size=64)), te=_standin())


def test_state_dict_maps_both_ways():
    plain = _model()
    te_model = convert_to_te(_model(), te=_standin())
    with torch.no_grad():
        for p in te_model.parameters():
            p.add_(torch.randn_like(p))  # "trained with TE"
    te_sd = te_model.state_dict()
    extra = [k for k in te_sd if k.endswith("._extra_state")]
    assert "layers.0.attention.wq._extra_state" in extra and "norm._extra_state" in extra
    # TE-trained checkpoint -> a plain model without TE, strictly.
    with pytest.raises(RuntimeError, match="_extra_state"):
        plain.load_state_dict(te_sd)
    plain.load_state_dict(te_to_torch_state_dict(te_sd))
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(plain(tokens), te_model(tokens))
    # Plain checkpoint -> a TE model, strictly.
    fresh = convert_to_te(_model(), te=_standin())
    with pytest.raises(RuntimeError, match="_extra_state"):
        fresh.load_state_dict(plain.state_dict())
    fresh.load_state_dict(torch_to_te_state_dict(plain.state_dict(), fresh))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), plain(tokens))


@pytest.mark.parametrize("new_api", [True, False])
@pytest.mark.parametrize(
    "name,cls",
    [
        ("delayed", "DelayedScaling"),
        ("current", "Float8CurrentScaling"),
        ("block", "Float8BlockScaling"),
        ("mxfp8", "MXFP8BlockScaling"),
    ],
)
def test_fp8_recipe_wraps_the_forward_in_te_autocast(name, cls, new_api):
    ref = _model(torch.float32, dim=64, ffn_hidden_dim=128)  # every linear dim a multiple of 32 (MXFP8)
    model = convert_to_te(copy.deepcopy(ref), name, te=_standin(new_api), capability=(10, 0))
    assert type(model._te_fp8_recipe).__name__ == cls
    assert isinstance(model, Transformer) and type(model).__name__ == "FP8Transformer"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens))
    seen = [m.seen_recipes for m in model.modules() if isinstance(m, (StandInLinear, StandInRMSNorm))]
    assert seen and all(s == [model._te_fp8_recipe] for s in seen)
    assert not _ACTIVE_RECIPE  # the context was left


def test_recipe_hardware_floors_are_one_line_errors():
    recipe = _standin().recipe
    for name, cap in (("mxfp8", (9, 0)), ("block", (8, 9)), ("delayed", (8, 0)), ("current", (8, 6))):
        with pytest.raises(ValueError) as err:
            make_fp8_recipe(name, recipe, cap)
        assert "compute capability" in str(err.value) and "\n" not in str(err.value)
    assert "mxfp8" in str(pytest.raises(ValueError, make_fp8_recipe, "mxfp8", recipe, (9, 0)).value)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        make_fp8_recipe("current", recipe, None)
    with pytest.raises(ValueError, match="float8.recipe must be"):
        make_fp8_recipe("fp4", recipe, (10, 0))
    assert make_fp8_recipe("", recipe, None) is None
    assert type(make_fp8_recipe("block", recipe, (9, 0))).__name__ == "Float8BlockScaling"


def test_fp8_refuses_unaligned_linears_and_tp_models():
    model = Transformer(FLAVORS["tiny"].replace(vocab_size=64, dim=40, n_heads=4, n_kv_heads=2))
    with pytest.raises(ValueError, match="multiples of 16"):
        convert_to_te(model, "current", te=_standin(), capability=(9, 0))
    model = Transformer(FLAVORS["tiny"].replace(vocab_size=64))  # kv dim 16, hidden 96: fine for FP8, not MXFP8
    with pytest.raises(ValueError, match="multiples of 32"):
        convert_to_te(copy.deepcopy(model), "mxfp8", te=_standin(), capability=(10, 0))
    convert_to_te(model, "current", te=_standin(), capability=(9, 0))
    assert type(model._te_fp8_recipe).__name__ == "Float8CurrentScaling"


def test_refuses_a_model_with_dtensor_parameters():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = _model(torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        wq = model.layers["0"].attention.wq
        wq.weight = nn.Parameter(distribute_tensor(wq.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match="before tensor parallelism"):
            convert_to_te(model, te=_standin())
    finally:
        dist.destroy_process_group()


def test_meta_model_converts_without_materialising():
    with torch.device("meta"):
        model = Transformer(FLAVORS["tiny"].replace(vocab_size=64))
    convert_to_te(model, te=_standin())
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()  # the blocks' init reaches the TE modules' weights by the same names
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kernels_dispatch():
    model = _model()
    assert convert_kernels(model, "torch") is model
    with pytest.raises(ValueError, match="needs model.kernels=te"):
        convert_kernels(model, "torch", "current")
    with pytest.raises(ValueError, match="torch or te"):
        convert_kernels(model, "triton")


def test_unloadable_te_is_one_clear_error():
    def broken_import(name):
        raise OSError("libcuda.so.1: cannot open shared object file:\n No such file or directory")

    with pytest.raises(TEUnavailableError) as err:
        load_te(broken_import)
    msg = str(err.value)
    assert "\n" not in msg and "model.kernels=te" in msg and "OSError: libcuda.so.1" in msg
    # The real environment: TE either loads, or fails with the same single-line error.
    if te_available():
        assert load_te().Linear.__module__.startswith("transformer_engine")
    else:
        with pytest.raises(TEUnavailableError, match="model.kernels=te needs NVIDIA Transformer Engine"):
            convert_to_te(_model())
