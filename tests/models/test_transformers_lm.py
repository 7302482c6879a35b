"""model.name = "hf": a transformers decoder-only model trained directly (titanlike/models/transformers_lm), against
the real library: the wrapper's forward is the library's, export is the model's own ``save_pretrained`` layout
(``from_pretrained`` loads it with equal logits), import reads it back, the plan translation, and every bad input
refused in one line before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the [hf] extra, installed by CI: a missing one fails, never skips
from hf_models import HF_CONFIGS, hf_folder

from titanlike.config import load_config, model_args_from_config
from titanlike.errors import ConfigError
from titanlike.hf import load_hf, save_hf
from titanlike.models import get_spec
from titanlike.models.transformers_lm import args_from_folder, sharding_for
from titanlike.parallel.ties import tie_groups
from titanlike.sharding import FusedColwise, HeadNorm, Region

FAMILIES = [k for k in HF_CONFIGS if k != "hf_phi3_mha"]


def _model(key: str):
    args = args_from_folder(hf_folder(key))
    torch.manual_seed(0)
    model = get_spec("hf").build(args).to(torch.float64)
    model.init_weights(seed=3)
    return args, model


@pytest.mark.parametrize("key", FAMILIES)
def test_export_loads_in_transformers_with_equal_logits_and_imports_back(key, tmp_path):
    args, model = _model(key)
    state = model.state_dict()
    out = save_hf(state, args, tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(input_ids=tokens).logits - model(tokens)).abs().max().item()
    print(key, "logits max |diff|", diff)
    assert diff <= 1e-13
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["dtype"] == "float64"
    loaded, file_args = load_hf(out, args)
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    assert file_args.config["model_type"] == HF_CONFIGS[key]["model_type"]


def test_sliding_window_configs_follow_transformers_masks():
    """Mistral (every layer) and Qwen2's use_sliding_window (from max_window_layers on): the wrapper hands each
    sliding layer the window's boolean mask, equal to the library's own forward (its create_sliding_window_causal_mask)
    in float64; the window acts (the same weights with the window off differ)."""
    from titanlike.models.transformers_lm.model import hf_config_object, layer_windows

    assert layer_windows(hf_config_object(HF_CONFIGS["hf_mistral_window"])) == [5, 5]
    assert layer_windows(hf_config_object(HF_CONFIGS["hf_qwen2_window"])) == [None, 5]
    assert layer_windows(hf_config_object(HF_CONFIGS["hf_qwen2_tied"])) == [None, None]
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    full = {"hf_mistral_window": dict(sliding_window=None), "hf_qwen2_window": dict(use_sliding_window=False)}
    for key, off in full.items():
        args, model = _model(key)
        for changes, equal in (({}, True), (off, False)):
            hf = transformers.AutoModelForCausalLM.from_config(
                hf_config_object({**HF_CONFIGS[key], **changes}), dtype=torch.float64, attn_implementation="sdpa"
            )
            hf.load_state_dict(_hf_names(model))
            with torch.no_grad():
                diff = (hf(input_ids=tokens, use_cache=False).logits - model(tokens)).abs().max().item()
            assert diff <= 1e-12 if equal else diff > 1e-4, (key, changes, diff)  # the window acts


def _hf_names(model) -> dict:
    """The wrapper's state dict in the library model's names."""
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith(("embed_tokens", "norm")):
            name = "model." + name
        elif name.startswith("layers."):
            name = "model." + name
        out[name] = t
    return out


def test_roles_ties_and_init():
    args, model = _model("hf_qwen2_tied")
    assert [n for n, _ in model.named_children()] == ["embed_tokens", "layers", "norm", "lm_head"]
    assert list(model.layers) == ["0", "1"]
    assert model.lm_head.weight is model.embed_tokens.weight  # one Parameter, found by identity
    assert tie_groups(model) == [["embed_tokens.weight", "lm_head.weight"]]
    norms = [p for n, p in model.named_parameters() if "layernorm" in n]
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    assert biases and all(torch.equal(p, torch.zeros_like(p)) for p in biases)
    std = model.layers["0"].mlp.up_proj.weight.std().item()
    assert abs(std - 0.02) < 0.004  # initializer_range


def test_plan_translation():
    phi3 = sharding_for(args_from_folder(hf_folder("hf_phi3")))
    assert phi3["layers.*.self_attn.qkv_proj"] == FusedColwise((4, 2, 2), head_dim=16, float8=False)
    assert phi3["layers.*.mlp.gate_up_proj"] == FusedColwise(2)
    assert phi3["layers.*.self_attn"] == Region(keyword="hidden_states")  # transformers calls attention by keyword
    assert phi3["layers.*.mlp"] == Region()
    qwen3 = sharding_for(args_from_folder(hf_folder("hf_qwen3")))
    assert qwen3["layers.*.self_attn.q_norm"] == HeadNorm() == qwen3["layers.*.self_attn.k_norm"]
    bad = args_from_folder(hf_folder("hf_qwen2_tied", base_model_tp_plan={"layers.*.mlp.up_proj": "local_colwise"}))
    with pytest.raises(ValueError, match="'layers.\\*.mlp.up_proj': 'local_colwise' has no exact titanlike style"):
        sharding_for(bad)


def _cfg(folder: str, *more: str):
    cfg = load_config(["--model.name", "hf", "--model.hf_config", folder, "--training.seq_len", "16", *more])
    return model_args_from_config(cfg)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(attention_dropout=0.1), "attention_dropout = 0.1 (dropout differs per layout; set it to 0)"),
        # Cohere multiplies the logits by logit_scale in CohereForCausalLM.forward, outside the modules
        (
            dict(model_type="cohere", architectures=["CohereForCausalLM"], logit_scale=0.0625),
            "its forward does more than embed_tokens",
        ),
        # Gemma 2 has no SDPA attention in transformers (the message is the library's, cut to one line)
        (
            dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], layer_types=["full_attention"] * 2),
            "transformers cannot build it (ValueError: Gemma2ForCausalLM does not support an attention",
        ),
        (dict(is_encoder_decoder=True), "is_encoder_decoder = true"),
        (dict(layer_types=["chunked_attention"] * 2), "layer_types ['chunked_attention']"),
        (dict(sliding_window=0), "sliding_window = 0"),
        # a mixture of experts, as transformers' Qwen3MoeConfig writes it: refused before its float64 forward check
        (
            dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4, moe_intermediate_size=8),
            "a mixture of experts (num_experts = 4) trains as titanlike's qwen3_moe model",
        ),
        # Mixtral: no titanlike model imports it, so the advice is not checkpoint.initial_load_path (which refuses
        # model_type 'mixtral' too)
        (
            dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4),
            "no titanlike MoE model imports model_type 'mixtral' yet: nothing trains it here yet",
        ),
        (dict(model_type="t5", architectures=["T5ForConditionalGeneration"]), "transformers cannot build it"),
    ],
)
def test_models_the_wrapper_cannot_train_exactly_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError) as e:
        _cfg(hf_folder("hf_qwen2_tied", **changes))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_folders_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _cfg(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="has no config.json"):
        _cfg(str(tmp_path))
    with pytest.raises(ConfigError, match="give the folder holding the model's config.json"):
        model_args_from_config(load_config(["--model.name", "hf"]))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        _cfg(str(tmp_path))
    with pytest.raises(ConfigError, match="model.hf_config: llama3 has no such setting"):
        load_config(["--model.hf_config", str(tmp_path)])


def test_a_moe_config_as_transformers_writes_it_is_refused_naming_the_moe_route(tmp_path):
    """The installed library's own Qwen3MoeConfig.save_pretrained (5.x writes num_local_experts): one line, exit-2
    material, pointing at titanlike's MoE model instead of failing in the float64 forward check."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)  # with its weights: the advice's route
    with pytest.raises(ConfigError) as e:
        _cfg(str(tmp_path))
    message = str(e.value)
    assert "a mixture of experts (num_" in message and "trains as titanlike's qwen3_moe model" in message, message
    assert "\n" not in message and "cannot build or run" not in message, message
    # the advice leads somewhere: the folder by checkpoint.initial_load_path selects the qwen3_moe model
    cfg = load_config(["--checkpoint.initial_load_path", str(tmp_path), "--training.seq_len", "16"], world_size=1)
    assert cfg.model.name == "qwen3_moe" and model_args_from_config(cfg).num_experts == 4


def test_a_mixtral_config_is_refused_without_advice_that_leads_nowhere(tmp_path):
    """transformers' own MixtralConfig.save_pretrained: no titanlike model imports model_type 'mixtral' (the
    checkpoint.initial_load_path route refuses it too), so the refusal says that nothing trains it yet."""
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        _cfg(str(tmp_path))
    message = str(e.value)
    assert "nothing trains it here yet" in message and "initial_load_path" not in message, message
    assert "\n" not in message, message
    with pytest.raises(ConfigError, match="model_type = 'mixtral'"):  # what the advice would have led to
        load_config(["--checkpoint.initial_load_path", str(tmp_path)], world_size=1)
