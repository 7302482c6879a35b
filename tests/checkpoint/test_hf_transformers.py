"""Hugging Face interop against the real ``transformers`` (the ``[hf]`` extra): Llama checkpoints as
``save_pretrained`` writes them (both config layouts, llama3 RoPE scaling, eps 1e-6, GQA, tied / untied, bf16,
sharded) import with transformers' logits, train, export and load back with ``from_pretrained``; every config.json
field titanlike cannot honour, or that disagrees with the configured model, is refused.

transformers is imported once per module (it takes seconds); the models are tiny.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # the [hf] extra (transformers 5), installed by CI: a missing one fails, never skips

from titanlike.config import ConfigError, load_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import HFConfigError, hf_architecture, load_hf, model_args_from_hf_config, save_hf
from titanlike.models import ModelArgs, Transformer
from titanlike.training.trainer import Trainer

TOL = 1e-5  # float32 logits: transformers computes RoPE angles in float32, titanlike in float64
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# dim 128 / 8 heads: head_dim 16, so the llama3 rule keeps, interpolates and stretches some frequency each.
BASE = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=256,
    bos_token_id=2001,
    eos_token_id=2000,
)
CASES = {
    # what the done-when names: transformers 5 layout, llama3 scaling, eps 1e-6, GQA, untied, sharded
    "v5_llama3_untied_sharded": dict(
        config=dict(rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=LLAMA3),
        dtype=torch.float32,
        shard="1MB",
    ),
    # transformers 4's layout (top-level rope_theta + rope_scaling), tied
    "v4_layout_llama3_tied": dict(
        config=dict(rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=LLAMA3),
        dtype=torch.float32,
        shard=None,
        v4=True,
    ),
    # bf16 weights, plain RoPE with another base, the default eps, GQA 8/4
    "bf16_default_rope": dict(
        config=dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
        dtype=torch.bfloat16,
        shard=None,
    ),
}


def to_v4_layout(folder: Path) -> None:
    """Rewrite a transformers-5 config.json as transformers 4 wrote it."""
    config = json.loads((folder / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.46.0"
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> a folder written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(i)
        config = transformers.LlamaConfig(**{**BASE, **case["config"]})
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # non-trivial norms, so that a swapped or mis-scaled norm shows
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))
        model = model.to(case["dtype"])
        kwargs = {"max_shard_size": case["shard"]} if case["shard"] else {}
        model.save_pretrained(root / name, **kwargs)
        if case.get("v4"):
            to_v4_layout(root / name)
        out[name] = root / name
    return out


def hf_model(folder, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def tokens(vocab: int, shape=(2, 48), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def ours_from(folder) -> tuple[Transformer, ModelArgs]:
    sd, args = load_hf(folder, dtype=torch.float32)
    model = Transformer(args)
    model.load_state_dict(sd)
    return model.eval(), args


@pytest.mark.parametrize("case", list(CASES))
def test_import_train_export_reload_against_transformers(case, saved, tmp_path):
    folder = saved[case]
    expect = CASES[case]
    if expect["shard"]:
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*"))) > 1
    if expect.get("v4"):
        assert "rope_parameters" not in json.loads((folder / "config.json").read_text())
    ours, args = ours_from(folder)
    assert args.norm_eps == expect["config"]["rms_norm_eps"]
    assert args.tie_embeddings == expect["config"]["tie_word_embeddings"]
    assert args.rope_scaling == ("llama3" if expect["config"]["rope_parameters"]["rope_type"] == "llama3" else "none")
    theirs = hf_model(folder)
    x = tokens(args.vocab_size)
    with torch.no_grad():
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff <= TOL, diff

    # One AdamW step in titanlike, export (the installed transformers' layout), load with from_pretrained.
    ours.train()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    loss = F.cross_entropy(ours(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    ours.eval()
    out = save_hf(ours.state_dict(), args, tmp_path / "export", max_shard_size="1MB", bos_id=2001, eos_id=2000)
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == 2001 and config["eos_token_id"] == 2000
    assert config["rope_parameters"]["rope_type"] == expect["config"]["rope_parameters"]["rope_type"]
    assert (out / "model.safetensors.index.json").is_file()
    reloaded = hf_model(out)
    assert reloaded.config.rms_norm_eps == args.norm_eps
    with torch.no_grad():
        trained = ours(x)
        diff = (trained - reloaded(x).logits).abs().max().item()
        moved = (trained - theirs(x).logits).abs().max().item()
    assert diff <= TOL, diff
    assert moved > 100 * TOL  # the step changed the model, and the export carries the change


def test_titanlike_export_resaved_by_transformers_comes_back_the_same(tmp_path):
    """titanlike (transformers-4 layout) -> from_pretrained -> save_pretrained (transformers-5 layout) -> titanlike:
    the rope base and scaling survive the change of layout; weights and logits are identical."""
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=300,
        ffn_hidden_dim=96,
        norm_eps=1e-6,
        rope_theta=500000.0,
        max_seq_len=128,
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=32,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    save_hf(model.state_dict(), args, tmp_path / "ours", layout=4)
    assert "rope_theta" in json.loads((tmp_path / "ours" / "config.json").read_text())
    hf = hf_model(tmp_path / "ours")
    hf.save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert resaved["rope_parameters"]["rope_theta"] == 500000.0 and "rope_theta" not in resaved
    back, back_args = ours_from(tmp_path / "resaved")
    assert back_args == args
    x = tokens(args.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
        assert (model(x) - hf(x).logits).abs().max().item() <= TOL


# --------------------------------------------------------------------------------------------- refusals
def _mutated(config: dict, key: str, value) -> dict:
    out = json.loads(json.dumps(config))
    if "." in key:
        outer, inner = key.split(".")
        out[outer][inner] = value
    else:
        out[key] = value
    return out


# (field, value, what the one-line error must contain): unsupported values, refused from config.json alone.
UNSUPPORTED = [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("attention_bias", True, "attention_bias = True"),
    ("mlp_bias", True, "mlp_bias = True"),
    ("attention_dropout", 0.1, "attention_dropout = 0.1"),
    ("head_dim", 32, "head_dim = 32"),
    ("model_type", "mistral", "model_type = 'mistral'"),
    ("architectures", ["MistralForCausalLM"], "architectures = ['MistralForCausalLM']"),
    ("rope_parameters.rope_type", "yarn", "rope type 'yarn'"),
    ("rope_parameters.partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("rope_parameters.mscale", 2.0, "rope mscale = 2.0"),
    ("rope_theta", 10000.0, "rope_theta = 10000.0 and rope_parameters.rope_theta = 500000.0 disagree"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "quantization_config"),
    ("sliding_window", 4096, "sliding_window = 4096"),
    ("rope_parameters.high_freq_factor", 0.5, "low_freq_factor 1.0 must be below high_freq_factor 0.5"),
]
# Shape fields: config.json alone is consistent, but the weights beside it are not.
SHAPES = [
    ("hidden_size", 256),
    ("num_hidden_layers", 3),
    ("num_key_value_heads", 4),
    ("intermediate_size", 256),
    ("vocab_size", 4096),
    ("tie_word_embeddings", True),
]


def test_every_config_field_titanlike_cannot_honour_is_refused(saved, tmp_path):
    folder = saved["v5_llama3_untied_sharded"]
    config = json.loads((folder / "config.json").read_text())
    model_args_from_hf_config(config)  # the unmutated file is fine
    for key, value, message in UNSUPPORTED:
        with pytest.raises(HFConfigError, match=None) as e:
            model_args_from_hf_config(_mutated(config, key, value))
        assert message in str(e.value) and "\n" not in str(e.value), (key, str(e.value))
    # All problems of one file in one line.
    bad = _mutated(_mutated(config, "hidden_act", "relu"), "mlp_bias", True)
    with pytest.raises(HFConfigError) as e:
        model_args_from_hf_config(bad)
    assert "hidden_act = 'relu'" in str(e.value) and "mlp_bias = True" in str(e.value)
    # Shape fields: the weights do not fit the architecture config.json claims.
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    for key, value in SHAPES:
        (copy / "config.json").write_text(json.dumps(_mutated(config, key, value)))
        with pytest.raises(ValueError, match="do not fit the model|cannot honour head_dim"):
            load_hf(copy)
    # Fields that change the computation but not the shapes are taken from config.json (and printed), never
    # silently replaced by a default: the imported model follows the file.
    for key, value, field in [
        ("rms_norm_eps", 1e-3, "norm_eps"),
        ("rope_parameters.rope_theta", 1e4, "rope_theta"),
        ("rope_parameters.factor", 4.0, "rope_scaling_factor"),
        ("rope_parameters.original_max_position_embeddings", 128, "rope_original_max_seq_len"),
        ("max_position_embeddings", 512, "max_seq_len"),
    ]:
        (copy / "config.json").write_text(json.dumps(_mutated(config, key, value)))
        assert getattr(hf_architecture(copy), field) == value


# titanlike option that disagrees with the folder's config.json -> refused, naming both values.
CONFLICTS = [
    ("dim", "64"),
    ("n_layers", "4"),
    ("n_heads", "4"),
    ("n_kv_heads", "8"),
    ("ffn_hidden_dim", "256"),
    ("max_seq_len", "512"),
    ("rope_theta", "10000"),
    ("norm_eps", "1e-5"),
    ("rope_scaling", "none"),
    ("rope_scaling_factor", "16"),
    ("rope_low_freq_factor", "2"),
    ("rope_high_freq_factor", "8"),
    ("rope_original_max_seq_len", "8192"),
    ("tie_embeddings", "true"),
]


def test_model_options_that_disagree_with_config_json_are_refused(saved):
    folder = str(saved["v5_llama3_untied_sharded"])
    for key, value in CONFLICTS:
        with pytest.raises(ConfigError) as e:
            load_config(["--checkpoint.initial_load_path", folder, f"--model.{key}", value], world_size=1)
        assert f"model.{key} " in str(e.value) and "config.json has" in str(e.value), (key, str(e.value))
    # the same values as the file are not a conflict
    load_config(
        ["--checkpoint.initial_load_path", folder, "--model.dim", "128", "--model.norm_eps", "1e-6"], world_size=1
    )


# --------------------------------------------------------------------------------------------- done-when
def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(saved, tmp_path, capsys):
    folder = saved["v5_llama3_untied_sharded"]
    cfg = load_config(
        [
            "--checkpoint.initial_load_path",
            str(folder),
            "--training.steps",
            "1",
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "64",
            "--data.path",
            str(asset_path("corpus", "tinyshakespeare.txt")),
            "--validation.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            "--job.dump_folder",
            str(tmp_path),
        ],
        world_size=1,
    )
    trainer = Trainer(cfg)
    printed = capsys.readouterr().out
    assert "architecture from" in printed and "rope_scaling llama3 (factor 8" in printed and "norm_eps 1e-06" in printed
    args = trainer.model_args
    assert (args.dim, args.n_kv_heads, args.vocab_size, args.tie_embeddings) == (128, 2, 2048, False)
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    with torch.no_grad():
        logits = hf_model(folder)(x).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)
