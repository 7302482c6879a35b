"""Qwen3-MoE against the real transformers ``Qwen3MoeForCausalLM``: a ``save_pretrained`` folder (every expert apart)
imports by folder with equal logits, transformers 5's fused in-memory experts import too, a trained model exports
back and reloads with equal logits; what Hugging Face's format cannot express is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from titanlike.config import load_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import from_hf, load_hf, model_args_from_hf_config, save_hf, to_hf
from titanlike.models import get_spec
from titanlike.training.trainer import Trainer

TOL = 1e-5  # float32 logits: transformers computes RoPE angles in float32, titanlike in float64
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],  # the first layer dense
    vocab_size=128,
    tie_word_embeddings=False,
)


def _theirs(seed: int = 0, **changes) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**CONFIG, **changes}))
    with torch.no_grad():  # a wide router, so the top-k is not decided by rounding; non-trivial norms
        for n, p in model.named_parameters():
            p.normal_(0, 0.3 if "mlp.gate." in n else 0.05).add_(1.0 if "norm" in n else 0.0)
    return model.eval()


def _ours(sd, args):
    model = get_spec("qwen3_moe").build(args)
    model.load_state_dict(sd)
    model.init_buffers()
    return model.eval()


def _tokens():
    return torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def test_save_pretrained_folder_imports_trains_exports_and_reloads(tmp_path):
    theirs = _theirs()
    theirs.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    sd, args = load_hf(tmp_path / "hf", dtype=torch.float32)
    assert (args.num_experts, args.top_k, args.moe_hidden_dim, args.n_dense_layers, args.route_norm) == (
        8,
        2,
        32,
        1,
        True,
    )
    assert args.load_balance_coeff is None and "model_type" in written
    ours, x = _ours(sd, args), _tokens()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL
    # one AdamW step in titanlike (the aux loss off, no bias: as imported), export, from_pretrained
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


def test_fused_in_memory_experts_import_too():
    theirs = _theirs(seed=2)
    assert "model.layers.1.mlp.experts.gate_up_proj" in theirs.state_dict()  # transformers 5's fused layout
    args = model_args_from_hf_config(theirs.config.to_dict())
    ours, x = _ours(from_hf(theirs.state_dict(), args), args), _tokens()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL


def test_what_hugging_face_cannot_express_is_refused():
    theirs = _theirs()
    args = model_args_from_hf_config(theirs.config.to_dict())
    ours = _ours(from_hf(theirs.state_dict(), args), args)
    biased = args.replace(load_balance_coeff=1e-3)
    sd = {**ours.state_dict(), **{f"layers.{i}.moe.expert_bias": torch.full((8,), 0.1) for i in (1, 2)}}
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM has no expert bias"):
        to_hf(sd, biased)
    assert get_spec("qwen3_moe").hf_export_violations(biased)  # and up front: layout rule export_model
    assert get_spec("qwen3_moe").hf_export_violations(args) == []
    for key, value, message in (
        ("decoder_sparse_step", 2, "decoder_sparse_step = 2"),
        ("mlp_only_layers", [1], "mlp_only_layers = [1]"),
        ("num_experts_per_tok", 9, "top_k 9 exceeds num_experts 8"),
    ):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            model_args_from_hf_config({**theirs.config.to_dict(), key: value})


def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(tmp_path, capsys):
    """No --model.* flag: config.json's model_type picks qwen3_moe and its architecture; step 1's loss is
    transformers' cross entropy on the same batch."""
    folder = tmp_path / "hf"
    _theirs(seed=3, vocab_size=2048).save_pretrained(folder)  # the test tokenizer's vocabulary
    argv = ["--checkpoint.initial_load_path", str(folder), "--training.steps", "1", "--training.local_batch_size"]
    argv += ["2", "--training.seq_len", "32", "--data.path", str(asset_path("corpus", "tinyshakespeare.txt"))]
    argv += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--job.dump_folder"]
    trainer = Trainer(load_config([*argv, str(tmp_path / "run")], world_size=1))
    printed = capsys.readouterr().out
    assert "architecture from" in printed and "num_experts 8" in printed and "M active per token" in printed
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)
