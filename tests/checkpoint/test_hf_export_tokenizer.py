"""A run's Hugging Face export works as it is: ``convert_checkpoint.py to-hf <checkpoint folder>`` (its newest step)
writes the tokenizer beside the weights (the shipped tiktoken ones converted to tokenizer.json, a Hugging Face
tokenizer folder copied, eos/bos named) and generation_config.json, with ordinary file modes; the folder loads in
``transformers.pipeline("text-generation")``, which generates our greedy tokens, and our own generate.py / eval.py
read it. The tiktoken conversion gives tiktoken's ids and transformers' ``TikTokenConverter``'s merges."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers  # the [hf] extra, installed by CI: a missing one fails, never skips

from titanlike.config import load_config
from titanlike.data import asset_path, build_tokenizer
from titanlike.data.tokenizer_export import save_hf_tokenizer, tiktoken_to_hf
from titanlike.generate import generate, load_model
from titanlike.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TEXT = asset_path("corpus", "tinyshakespeare.txt").read_text()[:6000] + " héllo 日本語 🙂\r\n\t  x  "


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", ["test", "gpt2", "cl100k"])
def test_converted_tiktoken_tokenizers_give_tiktokens_ids(name):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = build_tokenizer(name)
    ours = tiktoken_to_hf(tok)
    ours.encode_special_tokens = True  # as ours: special-token strings in text are text
    assert ours.encode(TEXT, add_special_tokens=False).ids == tok.encode(TEXT)
    assert ours.decode(tok.encode(TEXT)) == TEXT
    assert {t: ours.token_to_id(t) for t in tok.special_tokens} == tok.special_tokens  # cl100k's ids have gaps
    if name != "cl100k":  # its 100k ranks take seconds twice; the same code path
        files = {"test": "test_2k.tiktoken", "gpt2": "r50k_base.tiktoken"}
        theirs = TikTokenConverter(
            vocab_file=str(asset_path("tokenizers", files[name])), pattern=tok.encoding._pat_str
        ).converted()
        mine, want = json.loads(ours.to_str())["model"], json.loads(theirs.to_str())["model"]
        assert mine["merges"] == want["merges"] and mine["ignore_merges"] and want["ignore_merges"]
        assert mine.pop("vocab") == {**want.pop("vocab"), **tok.special_tokens} and mine == want


def _hf_tokenizer_folder(folder: Path) -> Path:
    """A Hugging Face tokenizer folder (the "test" ranks) whose eos is named only by config.json's eos_token_id."""
    folder.mkdir()
    save_hf_tokenizer(build_tokenizer("test"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2000}))
    return folder


def _train(tmp_path: Path, tokenizer: str) -> Path:
    argv = ["--model.flavor", "tiny", "--model.tokenizer", tokenizer, "--training.steps", "4"]
    argv += ["--training.local_batch_size", "2", "--training.seq_len", "32", "--validation.enable", "false"]
    argv += ["--data.path", str(asset_path("corpus", "tinyshakespeare.txt")), "--metrics.enable_tensorboard"]
    argv += ["false", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "--checkpoint.interval"]
    argv += ["2", "--training.dtype", "float32"]
    Trainer(load_config(argv, world_size=1)).train()
    return tmp_path / "run" / "checkpoint"


@pytest.mark.parametrize("kind", ["shipped", "hf_folder"])
def test_a_runs_export_generates_in_transformers_pipeline_and_our_scripts(tmp_path, kind, capsys):
    tokenizer = "test" if kind == "shipped" else str(_hf_tokenizer_folder(tmp_path / "tok"))
    checkpoint = _train(tmp_path, tokenizer)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step-2", "step-4"]
    assert _script("convert_checkpoint")(["to-hf", str(checkpoint), str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert "step-4" in capsys.readouterr().out  # the newest step
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~umask)}
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|end_of_text|>"  # named even where the source folder's config.json did
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2000

    ours = build_tokenizer(tokenizer)
    prompt = "ROMEO:\nWhat light"
    ids = ours.encode(prompt)
    (new,) = generate(load_model(checkpoint).model, [ids], 8)  # greedy, the newest step, stops at EOS
    pipe = transformers.pipeline("text-generation", model=str(out), dtype=torch.float32)
    assert pipe.tokenizer(prompt, add_special_tokens=True)["input_ids"] == ids  # no BOS added: as trained
    got = pipe(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert got == ours.decode([t for t in new if t != ours.eos_id]) and got.strip()

    assert _script("generate")(["--checkpoint", str(out), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    assert got in capsys.readouterr().out
    from titanlike.evaluation import TitanlikeLM

    lm = TitanlikeLM(checkpoint=str(out))  # eval.py's model: the folder's own tokenizer
    assert lm.tokenizer.encode(prompt) == ids and lm.tokenizer.eos_id == ours.eos_id


def test_to_hf_without_a_recorded_tokenizer_or_with_a_bad_one(tmp_path, capsys):
    from titanlike.checkpoint import write_seed_checkpoint
    from titanlike.models import get_spec

    spec = get_spec("llama3")
    args = spec.flavors["tiny"].replace(vocab_size=2048)
    model = spec.build(args)
    step = write_seed_checkpoint(dict(model.state_dict()), args, tmp_path / "step-0")
    main = _script("convert_checkpoint")
    assert main(["to-hf", str(step), str(tmp_path / "a")]) == 0  # records none: weights and config only
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    assert main(["to-hf", str(step), str(tmp_path / "b"), "--tokenizer", "test"]) == 0
    assert (tmp_path / "b" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["to-hf", str(step), str(tmp_path / "c"), "--tokenizer", "cl100k"]) == 2
    assert "has 100277 ids, the model of" in capsys.readouterr().err
    assert main(["to-hf", str(tmp_path / "a"), str(tmp_path / "d")]) == 2  # a Hugging Face folder: no step
    assert "is not a titanlike checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
