"""Qwen3-Next against the real transformers ``Qwen3NextForCausalLM`` (its torch fallback on CPU): a
``save_pretrained`` folder imports by folder (model.name from config.json), trains with its step-1 loss equal to
transformers' on the same batch, exports back and reloads with equal logits; ``model.name = "hf"`` refuses the
folder in one line naming qwen3_next."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from titanlike.config import ConfigError, load_config, model_args_from_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import load_hf, save_hf
from titanlike.models import get_spec
from titanlike.training.trainer import Trainer

TOL = 1e-5  # float32: transformers computes the delta rule, norms and RoPE in float32
CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    full_attention_interval=2,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
    vocab_size=2048,  # the test tokenizer's
    max_position_embeddings=128,
)


def _theirs(seed: int = 0) -> transformers.Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG))
    with torch.no_grad():  # non-trivial norms; a wide router (the top-k not decided by rounding)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "mlp.gate." in n:
                p.normal_(0, 0.3)
    return model.eval()


def _tokens():
    return torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def test_save_pretrained_folder_imports_exports_and_reloads(tmp_path):
    theirs = _theirs()
    theirs.save_pretrained(tmp_path / "hf")
    sd, args = load_hf(tmp_path / "hf", dtype=torch.float32)
    assert (args.full_attention_interval, args.linear_v_heads, args.rotary_dim, args.num_experts) == (2, 4, 8, 4)
    ours = get_spec("qwen3_next").build(args)
    ours.load_state_dict(sd)
    ours.init_buffers()
    ours.eval()
    x = _tokens()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL
    ours.train()  # one AdamW step in titanlike, export, from_pretrained
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


def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(tmp_path, capsys):
    """No --model.* flag: config.json's model_type picks qwen3_next and its architecture; step 1's loss is
    transformers' cross entropy on the same batch."""
    folder = tmp_path / "hf"
    _theirs(seed=3).save_pretrained(folder)
    argv = ["--checkpoint.initial_load_path", str(folder), "--training.steps", "1", "--training.local_batch_size"]
    argv += ["2", "--training.seq_len", "32", "--data.path", str(asset_path("corpus", "tinyshakespeare.txt"))]
    argv += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--job.dump_folder"]
    trainer = Trainer(load_config([*argv, str(tmp_path / "run")], world_size=1))
    assert "qwen3_next" in capsys.readouterr().out
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)


def test_model_name_hf_refuses_linear_attention_naming_qwen3_next(tmp_path):
    _theirs().config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        model_args_from_config(load_config(["--model.name", "hf", "--model.hf_config", str(tmp_path)]))
    message = str(e.value)
    assert "linear attention" in message and "qwen3_next" in message and "\n" not in message, message
