"""gpt-oss against the real transformers ``GptOssForCausalLM``: a sharded ``save_pretrained`` folder imports by folder
with equal logits (sliding-window and full layers, sinks, biases, the interleaved gate/up experts), trains from the
folder with no --model.* flag, its step-1 loss equal to transformers', exports back and reloads with equal logits;
MXFP4 expert weights dequantize exactly as ``transformers.integrations.mxfp4`` does; the planted adapter bugs (gate
and up de-interleaved wrongly, the clamp missing) break the comparison; what titanlike cannot honour is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

import titanlike.models.gpt_oss.hf as gpt_oss_hf
import titanlike.models.moe as moe
from titanlike.config import load_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import from_hf, load_hf, model_args_from_hf_config, save_hf
from titanlike.models import get_spec
from titanlike.training.trainer import Trainer

TOL = 1e-5  # float32 logits: transformers computes its RMSNorm and RoPE angles in float32, titanlike RoPE in float64
CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
    sliding_window=5,
    swiglu_limit=0.5,  # so the clamp acts at this scale
    max_position_embeddings=256,
)


def _theirs(seed: int = 0, **changes) -> transformers.GptOssForCausalLM:
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**CONFIG, **changes})
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # every parameter random (biases and sinks too), a wide router, non-trivial norms
        for n, p in model.named_parameters():
            p.normal_(0, 0.5 if "router" in n or "sinks" in n else 0.1).add_(1.0 if "norm" in n else 0.0)
    return model.eval()


def _ours(sd, args):
    model = get_spec("gpt_oss").build(args)
    model.load_state_dict(sd)
    model.init_buffers()
    return model.eval()


def _tokens(n: int = 24):
    return torch.randint(0, CONFIG["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))


def test_save_pretrained_folder_imports_exports_and_reloads(tmp_path):
    theirs = _theirs()
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded safetensors
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    sd, args = load_hf(tmp_path / "hf", dtype=torch.float32)
    assert written["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (args.sliding_window, args.window_of(0), args.window_of(1), args.rope_truncate) == (5, 5, None, False)
    ours, x = _ours(sd, args), _tokens()
    with torch.no_grad():
        logits = ours(x)
        assert (logits - theirs(x).logits).abs().max().item() <= TOL
        # the window and the sinks act: without either the logits differ
        for off in (args.replace(sliding_window=10**6), args.replace(attention_sinks=False)):
            sd_off = {k: v for k, v in sd.items() if off.attention_sinks or "sinks" not in k}
            assert (_ours(sd_off, off)(x) - logits).abs().max().item() > 1e-3
    ours.train()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    F.cross_entropy(ours(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    ours.eval()
    out = save_hf(ours.state_dict(), args, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        trained = ours(x)
        assert (trained - reloaded(x).logits).abs().max().item() <= TOL
        assert (trained - theirs(x).logits).abs().max().item() > 100 * TOL  # the step moved it; the export has it


@pytest.mark.parametrize("mutation", ["deinterleave_halves", "clamp_missing"])
def test_planted_bugs_break_the_comparison(mutation, monkeypatch):
    theirs = _theirs(seed=4)
    args = model_args_from_hf_config(theirs.config.to_dict())
    if mutation == "deinterleave_halves":  # gate = the first half of gate_up, up = the second (not even / odd)
        orig = gpt_oss_hf._experts_from_hf

        def halves(layer, parts):
            gu = parts["gate_up_proj"]
            parts["gate_up_proj"] = torch.stack(gu.chunk(2, dim=2), dim=3).flatten(2)  # even/odd := halves
            return orig(layer, parts)

        monkeypatch.setattr(gpt_oss_hf, "_experts_from_hf", halves)
    else:
        monkeypatch.setattr(moe, "clamped_swiglu", lambda g, u, alpha, limit: (u + 1) * g * torch.sigmoid(alpha * g))
    ours, x = _ours(from_hf(theirs.state_dict(), args), args), _tokens()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() > 1e-3


def _mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks (E, out, G, 16) and scales (E, out, G) for a weight (E, in = 32 G, out)."""
    e, n_in, n_out = shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def _mxfp4_folder(theirs, folder):
    """``theirs`` saved as the published checkpoints are: the experts as random MXFP4 blocks and scales (seeded
    per layer and projection, as ``_mxfp4``), quantization_config mxfp4. Returns the folder and its config."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    config = {**theirs.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    for i in range(theirs.config.num_hidden_layers):
        for j, proj in enumerate(("gate_up_proj", "down_proj")):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            sd[name + "_blocks"], sd[name + "_scales"] = _mxfp4(tuple(sd.pop(name).shape), seed=10 * i + j)
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config


def test_mxfp4_folder_dequantizes_as_transformers_does(tmp_path):
    """An MXFP4 checkpoint (the published form: experts as E2M1 blocks with E8M0 scales, quantization_config mxfp4)
    imports into the training dtype equal, bit for bit, to transformers' own CPU dequantization; the model then
    computes what transformers computes with those weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = _theirs(seed=5)
    folder, config = _mxfp4_folder(theirs, tmp_path / "mxfp4")
    for i in range(CONFIG["num_hidden_layers"]):
        for j, proj in enumerate(("gate_up_proj", "down_proj")):
            blocks, scales = _mxfp4(tuple(getattr(theirs.model.layers[i].mlp.experts, proj).shape), seed=10 * i + j)
            want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert torch.equal(gpt_oss_hf.dequantize_mxfp4(blocks, scales, torch.float32), want)
            with torch.no_grad():
                getattr(theirs.model.layers[i].mlp.experts, proj).copy_(want)  # transformers' model, dequantized
    ours_sd, args = load_hf(folder, dtype=torch.float32)
    gate_up = theirs.model.layers[1].mlp.experts.gate_up_proj.transpose(1, 2)
    assert torch.equal(ours_sd["layers.1.moe.experts.w1"], gate_up[:, 0::2])
    assert torch.equal(ours_sd["layers.1.moe.experts.w3"], gate_up[:, 1::2])
    x = _tokens()
    with torch.no_grad():
        assert (_ours(ours_sd, args)(x) - theirs(x).logits).abs().max().item() <= 1e-4  # big fp4 values: scale
    with pytest.raises(ValueError, match="quantization_config"):  # other quantizations are still refused
        model_args_from_hf_config({**config, "quantization_config": {"quant_method": "fp8"}})


def test_what_titanlike_cannot_honour_is_refused():
    config = _theirs().config.to_dict()
    for key, value, message in (
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("attention_dropout", 0.1, "attention_dropout = 0.1"),
        ("layer_types", ["chunked_attention"] * 3, "layer_types"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}, "rope type 'linear'"),
    ):
        with pytest.raises(ValueError, match=message):
            model_args_from_hf_config({**config, key: value})
    args = model_args_from_hf_config(config)
    assert get_spec("gpt_oss").hf_export_violations(args) == []
    assert get_spec("gpt_oss").hf_export_violations(args.replace(load_balance_coeff=1e-3))


def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(tmp_path, capsys):
    """No --model.* flag: config.json's model_type picks gpt_oss and its architecture; step 1's loss is
    transformers' cross entropy on the same batch."""
    folder = tmp_path / "hf"
    _theirs(seed=3, vocab_size=2048).save_pretrained(folder)  # the test tokenizer's vocabulary
    argv = ["--checkpoint.initial_load_path", str(folder), "--training.steps", "1", "--training.local_batch_size"]
    argv += ["2", "--training.seq_len", "32", "--data.path", str(asset_path("corpus", "tinyshakespeare.txt"))]
    argv += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--job.dump_folder"]
    trainer = Trainer(load_config([*argv, str(tmp_path / "run")], world_size=1))
    printed = capsys.readouterr().out
    assert "architecture from" in printed and "sliding_window 5" in printed
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)


def test_an_mxfp4_folder_and_its_from_hf_seed_train_from_their_own_architecture(tmp_path, capsys):
    """checkpoint.initial_load_path an MXFP4 folder trains (the fit check sees the uint8 blocks as they are); its
    ``from-hf`` seed, whose shape no model.* key expresses (moe_hidden_dim 32, head_dim 16, YaRN, clamp 0.5), starts
    from its checkpoint.json with the same step-1 loss; a model.* option that disagrees with the seed is refused."""
    import importlib.util
    from pathlib import Path

    from titanlike.errors import ConfigError

    folder, _ = _mxfp4_folder(_theirs(seed=5, vocab_size=2048), tmp_path / "mxfp4")
    argv = ["--training.steps", "1", "--training.local_batch_size", "2", "--training.seq_len", "32"]
    argv += ["--data.path", str(asset_path("corpus", "tinyshakespeare.txt")), "--validation.enable", "false"]
    argv += ["--metrics.enable_tensorboard", "false"]

    def run(source, name, *extra):
        cfg = load_config([*argv, "--checkpoint.initial_load_path", str(source), "--job.dump_folder", name, *extra])
        trainer = Trainer(cfg)
        return trainer, trainer.train()[0]

    trainer, loss = run(folder, str(tmp_path / "a"))
    printed = capsys.readouterr().out
    assert f"model: architecture from {folder} config.json: dim 64" in printed and "model gpt_oss: " in printed
    assert "flavor" not in printed  # the architecture did not come from one
    script = Path(__file__).resolve().parents[2] / "scripts" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    seed = tmp_path / "seed" / "step-0"
    assert convert.main(["from-hf", str(folder), str(seed)]) == 0
    capsys.readouterr()
    again, seed_loss = run(seed, str(tmp_path / "b"))
    assert "checksums verified while read" in capsys.readouterr().out  # the seed records its checksums
    assert again.model_args == trainer.model_args and seed_loss == loss
    args = again.model_args
    assert (args.moe_hidden_dim, args.swiglu_limit, args.rope_scaling) == (32, 0.5, "yarn")
    with pytest.raises(ConfigError, match=r"disagrees with model.sliding_window 7 \(checkpoint.json has 5\)"):
        run(seed, str(tmp_path / "c"), "--model.sliding_window", "7")
    with pytest.raises(ConfigError, match="is a gpt_oss model \\(its checkpoint.json\\), model.name is llama3"):
        run(seed, str(tmp_path / "d"), "--model.name", "llama3")
