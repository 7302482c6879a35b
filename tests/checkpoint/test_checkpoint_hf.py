"""Hugging Face Llama interop: the RoPE permutation, logits of a rotate-half Llama written here, the conversion
script both ways, and the trainer's export / start from a .safetensors file."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from titanlike.checkpoint import read_meta, read_model_state_dict, write_seed_checkpoint
from titanlike.config import load_config
from titanlike.data import asset_path
from titanlike.hf import from_hf, hf_config, load_hf, to_hf
from titanlike.models import FLAVORS, ModelArgs, Transformer
from titanlike.models.llama.hf import permute_from_hf, permute_to_hf
from titanlike.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
ARGS = {  # GQA (8 query heads over 4 kv heads), both head layouts of the output projection
    "untied": FLAVORS["debugmodel"].replace(dim=64, n_layers=2, vocab_size=96, rope_theta=500000.0, norm_eps=1e-6),
    "tied": FLAVORS["tiny"].replace(vocab_size=80, tie_embeddings=True),
}


def _convert_main():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def model64(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args).to(torch.float64)
    model.init_weights()  # float64 RoPE tables too
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show, and peaked attention, so RoPE does
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10.0)
    return model


def hf_llama_logits(sd: dict[str, torch.Tensor], config: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Hugging Face ``LlamaForCausalLM`` forward, written out: rotate-half RoPE on cos/sin of cat(freqs, freqs)."""
    dim, n_heads, n_kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps, (bsz, seq) = dim // n_heads, config["rms_norm_eps"], tokens.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), dim=-1)

    theta = config["rope_parameters"]["rope_theta"] if "rope_parameters" in config else config["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in sd.items() if k.startswith(f"model.layers.{i}.")}
        x = rms(h, w["input_layernorm.weight"])
        q = (x @ w["self_attn.q_proj.weight"].T).view(bsz, seq, n_heads, hd).transpose(1, 2)
        k = (x @ w["self_attn.k_proj.weight"].T).view(bsz, seq, n_kv, hd).transpose(1, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).view(bsz, seq, n_kv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(n_heads // n_kv, 1), v.repeat_interleave(n_heads // n_kv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(bsz, seq, dim) @ w["self_attn.o_proj.weight"].T
        x = rms(h, w["post_attention_layernorm.weight"])
        gate, up = F.silu(x @ w["mlp.gate_proj.weight"].T), x @ w["mlp.up_proj.weight"].T
        h = h + (gate * up) @ w["mlp.down_proj.weight"].T
    head = sd["model.embed_tokens.weight"] if config["tie_word_embeddings"] else sd["lm_head.weight"]
    return rms(h, sd["model.norm.weight"]) @ head.T


def test_permutation_moves_interleaved_pairs_to_halves_and_back():
    n_heads, hd, dim = 3, 8, 5
    w = torch.arange(n_heads * hd * dim, dtype=torch.float64).view(n_heads * hd, dim)
    out = permute_to_hf(w, n_heads)
    for h in range(n_heads):
        for i in range(hd // 2):
            for c in range(2):  # our row 2i + c of head h is HF's row c * hd/2 + i
                assert torch.equal(out[h * hd + c * hd // 2 + i], w[h * hd + 2 * i + c])
    assert torch.equal(permute_from_hf(out, n_heads), w)
    assert not torch.equal(out, w)


@pytest.mark.parametrize("kind", list(ARGS))
def test_state_dict_round_trip_and_names(kind):
    args = ARGS[kind]
    sd = model64(args).state_dict()
    hf = to_hf(sd, args)
    assert "model.embed_tokens.weight" in hf and "model.norm.weight" in hf
    assert ("lm_head.weight" in hf) == (not args.tie_embeddings)
    for i in range(args.n_layers):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ):
            assert f"model.layers.{i}.{name}.weight" in hf
    back = from_hf(hf, args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("kind", list(ARGS))
def test_exported_weights_are_a_faithful_rotate_half_llama(kind):
    args = ARGS[kind]
    model = model64(args)
    tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    ours = model(tokens)
    config = hf_config(args)
    theirs = hf_llama_logits(to_hf(model.state_dict(), args), config, tokens)
    assert (ours - theirs).abs().max() <= 1e-10
    # The permutation is what makes it so: the unpermuted weights are a different model under rotate-half RoPE.
    plain = {k: v for k, v in to_hf(model.state_dict(), args).items()}
    for name, t in model.state_dict().items():
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            plain[
                name.replace("attention.wq", "self_attn.q_proj")
                .replace("attention.wk", "self_attn.k_proj")
                .replace("layers.", "model.layers.", 1)
            ] = t
    assert (ours - hf_llama_logits(plain, config, tokens)).abs().max() > 0.05


def test_convert_script_both_ways_keeps_the_logits(tmp_path):
    args = ARGS["untied"]
    model = model64(args).float()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    write_seed_checkpoint(sd, args, tmp_path / "step-0")
    main = _convert_main()
    assert main(["to-hf", str(tmp_path / "step-0"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rope_parameters",
            "rms_norm_eps",
            "tie_word_embeddings",
            "max_position_embeddings",
            "dtype",
        )
    } == {
        "hidden_size": 64,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "vocab_size": 96,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": args.max_seq_len,
        "dtype": "float32",
    }
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(to_hf(sd, args))

    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back" / "step-0")]) == 0
    assert read_meta(tmp_path / "back" / "step-0")["kind"] == "seed"
    back = read_model_state_dict(tmp_path / "back" / "step-0")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    imported = Transformer(args)
    imported.load_state_dict(back)
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    assert torch.equal(imported(tokens), model(tokens))

    # Sharded above --max-shard-size (as save_pretrained names the files), cast on request; loads back.
    assert (
        main(
            [
                "to-hf",
                str(tmp_path / "step-0"),
                str(tmp_path / "hf16"),
                "--max-shard-size",
                "20KB",
                "--dtype",
                "bfloat16",
                "--tokenizer",
                "test",
                "--no-tokenizer",  # its ids only: this model's 96-token vocabulary cannot hold its files' 2008
            ]
        )
        == 0
    )
    shards = sorted(p.name for p in (tmp_path / "hf16").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    config16 = json.loads((tmp_path / "hf16" / "config.json").read_text())
    assert (config16["dtype"], config16["bos_token_id"], config16["eos_token_id"]) == ("bfloat16", 2001, 2000)
    back16, _ = load_hf(tmp_path / "hf16")
    assert all(torch.equal(back16[k], sd[k].to(torch.bfloat16)) for k in sd)

    # Nothing is written over: both directions refuse an existing output.
    assert main(["to-hf", str(tmp_path / "step-0"), str(tmp_path / "hf")]) == 2
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back" / "step-0")]) == 2
    assert main(["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2


def test_trainer_exports_hf_and_another_run_starts_from_the_safetensors(tmp_path):
    corpus = str(asset_path("corpus", "tinyshakespeare.txt"))
    common = [
        "--model.flavor",
        "tiny",
        "--model.tie_embeddings",
        "true",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "16",
        "--data.path",
        corpus,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "100",
    ]
    trainer = Trainer(
        load_config(
            [
                *common,
                "--training.steps",
                "3",
                "--job.dump_folder",
                str(tmp_path / "a"),
                "--checkpoint.enable",
                "--checkpoint.export_safetensors",
            ],
            world_size=1,
        )
    )
    trainer.train()
    final = tmp_path / "a" / "checkpoint" / "final"
    assert sorted(p.name for p in final.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    weights, args = load_hf(final)
    assert args.tie_embeddings and "output.weight" in weights
    trained = trainer.model_parts[0].state_dict()
    assert all(torch.equal(weights[k], trained[k]) for k in trained)

    other = Trainer(
        load_config(
            [
                *common,
                "--training.steps",
                "1",
                "--training.seed",
                "5",
                "--job.dump_folder",
                str(tmp_path / "b"),
                "--checkpoint.initial_load_path",
                str(final / "model.safetensors"),
            ],
            world_size=1,
        )
    )
    other.checkpointer.load()
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(other.model_parts[0](tokens), trainer.model_parts[0](tokens))


# ------------------------------------------------------------------------------------------ the adapter protocol
def test_every_model_adapter_implements_the_protocol_and_hf_names_no_model():
    from titanlike import hf
    from titanlike.models import get_spec, registered

    adapters = {name: hf.adapter_for(get_spec(name).args_cls()) for name in registered() if get_spec(name).hf_adapter}
    assert all(isinstance(ad, hf.HFAdapter) for ad in adapters.values())
    # the transformers model (model.name = "hf") reads any model_type, for its own weights only: never picked by one
    assert [n for n, ad in adapters.items() if getattr(ad, "ANY_MODEL_TYPE", False)] == ["hf"]
    adapters.pop("hf")
    assert {name: ad.MODEL_TYPE for name, ad in adapters.items()} == {
        "deepseek_v3": "deepseek_v3",
        "gpt2": "gpt2",
        "gpt_oss": "gpt_oss",
        "llama3": "llama",
        "qwen3": "qwen3",
        "qwen3_moe": "qwen3_moe",
        "qwen3_next": "qwen3_next",
    }
    # titanlike/hf/ is model-independent: no registered model's name, model_type or class appears in it.
    words = {w.lower() for ad in adapters.values() for w in (ad.MODEL_TYPE, ad.ARCHITECTURE)} | set(adapters)
    for path in (REPO / "titanlike" / "hf").glob("*.py"):
        text = path.read_text().lower()
        assert not [w for w in words if w in text], path
    # model_type picks the adapter; none or an unknown one is one line listing those titanlike imports.
    for config, message in (({}, "no model_type"), ({"model_type": "mistral"}, "model_type = 'mistral'")):
        with pytest.raises(
            hf.HFConfigError,
            match=message
            + r" \(titanlike imports 'deepseek_v3', 'gpt2', 'gpt_oss', 'llama', 'qwen3', 'qwen3_moe', "
            + r"'qwen3_next'\)",
        ):
            hf.model_args_from_hf_config(config)


def test_an_adapter_lacking_a_member_is_refused_in_one_line(monkeypatch):
    import dataclasses
    import sys
    import types

    from titanlike import hf
    from titanlike.models import get_spec
    from titanlike.models import spec as spec_module

    half = types.ModuleType("half_adapter")  # a model's hf.py with two of the protocol's members
    half.MODEL_TYPE, half.to_hf = "gpt2", lambda sd, args: sd
    monkeypatch.setitem(sys.modules, "half_adapter", half)
    gpt2 = get_spec("gpt2")
    monkeypatch.setitem(spec_module._REGISTRY, "gpt2", dataclasses.replace(gpt2, hf_adapter="half_adapter"))
    message = (
        "model 'gpt2': its Hugging Face adapter half_adapter lacks ARCHITECTURE, from_hf, hf_name, shape_hint, "
        "hf_config, model_args_from_hf_config, check_same_architecture, describe (see docs/adding_a_model.md)"
    )
    with pytest.raises(TypeError) as e:
        hf.to_hf({}, gpt2.args_cls())
    assert str(e.value) == message
