"""Qwen3 against the real ``transformers`` (the ``[hf]`` extra): a ``Qwen3ForCausalLM`` folder written by
``save_pretrained`` (sharded, or tied) imports with transformers' logits, exports back (``save_hf``) into a folder
``from_pretrained`` loads with the same logits, and trains with no ``--model.*`` option (``model.name`` and the
architecture come from its config.json), its first loss equal to transformers' on the same batch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers  # the [hf] extra (transformers 5), installed by CI: a missing one fails, never skips

from titanlike.config import load_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import hf_architecture, load_hf, save_hf
from titanlike.models.qwen3 import Qwen3, Qwen3Args
from titanlike.training.trainer import Trainer

TOL = 1e-5  # float32 logits: transformers computes RoPE angles in float32, titanlike in float64
BASE = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,  # q is 256 wide, not hidden_size
    vocab_size=2048,  # >= the test tokenizer's 2,000 ids
    max_position_embeddings=128,
    rope_theta=1_000_000.0,
)
CASES = {"untied_sharded": dict(tie_word_embeddings=False, shard="200KB"), "tied": dict(tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> a folder written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(i)
        config = transformers.Qwen3Config(**BASE, tie_word_embeddings=case["tie_word_embeddings"])
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():  # non-trivial norms (q / k norms too), so that a swapped or mis-scaled norm shows
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(root / name, **({"max_shard_size": case["shard"]} if "shard" in case else {}))
        out[name] = root / name
    return out


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def tokens(vocab: int = 2048, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_reload_against_transformers(case, saved, tmp_path):
    folder = saved[case]
    if case == "untied_sharded":
        assert (folder / "model.safetensors.index.json").is_file()  # really sharded
    args = hf_architecture(folder)
    assert isinstance(args, Qwen3Args) and args.head_dim == 32 and args.tie_embeddings == (case == "tied")
    sd, args = load_hf(folder, dtype=torch.float32)
    ours = Qwen3(args)
    ours.load_state_dict(sd)
    ours.eval()
    x = tokens()
    with torch.no_grad():
        expected = hf_model(folder)(x).logits
        assert (ours(x) - expected).abs().max().item() <= TOL
    out = save_hf(ours.state_dict(), args, tmp_path / "export", max_shard_size="200KB")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    with torch.no_grad():
        assert (hf_model(out)(x).logits - expected).abs().max().item() <= TOL
    back, back_args = load_hf(out)
    assert back_args == args and all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(saved, tmp_path, capsys):
    folder = saved["untied_sharded"]
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
    assert cfg.model.name == "qwen3"  # from config.json's model_type
    trainer = Trainer(cfg)
    assert "architecture from" in capsys.readouterr().out
    assert (trainer.model_args.dim, trainer.model_args.head_dim, trainer.model_args.vocab_size) == (128, 32, 2048)
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    with torch.no_grad():
        logits = hf_model(folder)(x).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)
