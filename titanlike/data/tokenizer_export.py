"""A tokenizer as the files of a Hugging Face folder, so that ``AutoTokenizer`` / ``pipeline()`` read an exported
model folder as it is.

* a Hugging Face tokenizer (:class:`~titanlike.data.HFTokenizer`): its folder's tokenizer files copied
  (tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...), ``tokenizer_config.json`` given the
  ``eos_token`` / ``bos_token`` the run used when the folder named them only through its config.json ids;
* a tiktoken tokenizer (:class:`~titanlike.data.Tokenizer`: "test", "gpt2", "cl100k" or a rank file): converted to a
  ``tokenizer.json`` as transformers' ``TikTokenConverter`` converts (byte-level BPE, its merges recovered from the
  ranks, the split pattern, ``ignore_merges``), built here with the ``tokenizers`` library so that no transformers
  is needed; the special tokens keep their ids (cl100k's are not contiguous) and ``tokenizer_config.json`` names
  eos and bos. The same ids as tiktoken's (tests/checkpoint/test_export_tokenizer.py, against transformers'
  converter and against tiktoken on the shipped corpus).

Neither adds BOS/EOS on encode (``transformers``' ``add_special_tokens=True`` adds nothing): training joined
documents with EOS and never prepended BOS unless the tokenizer's own post-processor did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titanlike.data.hf_tokenizer import TOKENIZER_FILE, HFTokenizer

__all__ = ["HF_TOKENIZER_FILES", "save_hf_tokenizer", "tiktoken_to_hf"]

# The files of a Hugging Face tokenizer folder (what save_pretrained writes, for fast and slow tokenizers).
HF_TOKENIZER_FILES = (
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
CONFIG_FILE = "tokenizer_config.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (transformers' ``bytes_to_unicode``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiktoken_to_hf(tokenizer):
    """A ``tokenizers.Tokenizer`` with the ids of the tiktoken ``tokenizer`` (a :class:`titanlike.data.Tokenizer`):
    transformers' ``TikTokenConverter`` algorithm, special tokens at their own ids."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    ranks: dict[bytes, int] = tokenizer.encoding._mergeable_ranks
    pattern: str = tokenizer.encoding._pat_str
    byte_map = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_map[c] for c in b)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[text(token)] = rank
        local = [
            (token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks and token in ranks
        ]
        merges.extend(sorted(local, key=lambda m: (ranks[m[0]], ranks[m[1]])))
    merges.sort(key=lambda m: m[2])
    # The specials join the model's vocabulary at their ids, so that adding them keeps those ids (gaps allowed).
    vocab.update(tokenizer.special_tokens)
    tk = RustTokenizer(BPE(vocab, [(text(a), text(b)) for a, b, _ in merges], fuse_unk=False, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokenizer.special_tokens])
    return tk


def _token(tokenizer, tid: int | None) -> str | None:
    if tid is None:
        return None
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend.id_to_token(tid)
    return next(t for t, i in tokenizer.special_tokens.items() if i == tid)


def save_hf_tokenizer(tokenizer, folder: str | Path, model_max_length: int | None = None) -> list[str]:
    """Write ``tokenizer`` (ours: tiktoken or Hugging Face) into ``folder`` as Hugging Face tokenizer files; returns
    the names written. ``model_max_length``: the model's context, recorded for a converted tokenizer."""
    folder = Path(folder)
    eos, bos = _token(tokenizer, tokenizer.eos_id), _token(tokenizer, tokenizer.bos_id)
    if isinstance(tokenizer, HFTokenizer):
        source = Path(tokenizer.path)
        written = []
        for name in HF_TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
                written.append(name)
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")) if CONFIG_FILE in written else {}
        missing = {k: v for k, v in (("eos_token", eos), ("bos_token", bos)) if v is not None and not config.get(k)}
        if missing or CONFIG_FILE not in written:
            config = {"tokenizer_class": "PreTrainedTokenizerFast", **config, **missing}
            (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
            written += [] if CONFIG_FILE in written else [CONFIG_FILE]
        return written
    tiktoken_to_hf(tokenizer).save(str(folder / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "clean_up_tokenization_spaces": False}
    if bos is not None:
        config["bos_token"] = bos
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [TOKENIZER_FILE, CONFIG_FILE]
