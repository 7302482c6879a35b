"""Data files as corpora ship them, written by the real libraries for the tests (no downloads): documents cut from
the shipped corpus, JSON lines plain / gzip / zstandard (several frames), parquet (several row groups), and a
Hugging Face tokenizer folder trained with ``tokenizers`` and saved by ``transformers``' ``save_pretrained``."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from titanlike.data import asset_path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def documents(n: int, seed: int = 0, max_paragraphs: int = 4) -> list[str]:
    """``n`` documents of 1..max_paragraphs paragraphs of tinyshakespeare, some with non-ASCII text."""
    paras = [p for p in asset_path("corpus", "tinyshakespeare.txt").read_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    docs = ["\n\n".join(rng.sample(paras, rng.randint(1, max_paragraphs))) for _ in range(n)]
    return [d + (" — ünïcödé 🙂" if i % 7 == 3 else "") for i, d in enumerate(docs)]


def _lines(docs: list[str], field: str) -> bytes:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_bytes(_lines(docs, field))
    return path


def write_jsonl_gz(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_bytes(gzip.compress(_lines(docs, field)))
    return path


def write_jsonl_zst(path: Path, docs: list[str], field: str = "text", frames: int = 2, checksum: bool = True) -> Path:
    """Several concatenated zstandard frames (as the Pile's files hold), each with a content checksum (zstd's CLI
    default)."""
    import zstandard

    c = zstandard.ZstdCompressor(write_checksum=checksum)
    k = max(1, len(docs) // frames)
    parts = [docs[i : i + k] for i in range(0, len(docs), k)]
    path.write_bytes(b"".join(c.compress(_lines(p, field)) for p in parts))
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text", row_group_size: int = 50) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), str(path), row_group_size=row_group_size)
    return path


def make_hf_tokenizer(
    folder: Path,
    vocab_size: int = 400,
    eos_in_tokenizer_json: bool = True,
    config_json: dict | None = None,
    save_pretrained: bool = False,
) -> Path:
    """A byte-level BPE (Llama-3 style: a template post-processor adding BOS) trained on a slice of tinyshakespeare
    with ``tokenizers``: tokenizer.json + tokenizer_config.json naming BOS / EOS, written by ``transformers``'
    ``PreTrainedTokenizerFast.save_pretrained`` (``save_pretrained=True``) or by hand with the same content (no
    transformers import). ``eos_in_tokenizer_json=False`` leaves BOS / EOS out of tokenizer.json (named only by
    tokenizer_config.json, as torchtitan's test folder has them); ``config_json`` writes a config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = asset_path("corpus", "tinyshakespeare.txt").read_text()[:100_000] + " ünïcödé 🙂 漢字"
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, "<|reserved_0|>"] if eos_in_tokenizer_json else ["<|reserved_0|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([text[i : i + 5000] for i in range(0, len(text), 5000)], trainer)
    if eos_in_tokenizer_json:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tk.token_to_id(BOS))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    if save_pretrained:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS).save_pretrained(str(folder))
    else:
        tk.save(str(folder / "tokenizer.json"))
        config = {"backend": "tokenizers", "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "TokenizersBackend"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if config_json is not None:
        (folder / "config.json").write_text(json.dumps(config_json))
    return folder


def make_tokenizer_without_its_unknown_token(folder: Path) -> Path:
    """A word-level BPE over the letters only whose tokenizer.json names an unknown token ``<unk>`` its vocabulary
    lacks: the ``tokenizers`` library raises on any other character (a digit, punctuation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    vocab = {t: i for i, t in enumerate([*letters, "</s>"])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder
