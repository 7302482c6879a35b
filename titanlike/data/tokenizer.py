"""Tokenizers, offline: byte-level BPE from local tiktoken rank files, or a Hugging Face tokenizer.json.

`tiktoken.get_encoding(...)` downloads its rank files; here every encoding is built from a file
shipped in titanlike/assets/tokenizers (or any user-supplied ``.tiktoken`` file), so nothing ever
touches the network. A folder holding a ``tokenizer.json`` (or that file) is a Hugging Face tokenizer, read by
``titanlike.data.hf_tokenizer`` with the same interface.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import tiktoken
import tiktoken.load

from titanlike.data.hf_tokenizer import HFTokenizer, hf_tokenizer_file
from titanlike.data.tokenizer_base import SpecialTokens

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


def asset_path(*parts: str) -> Path:
    """Path of a file shipped in titanlike/assets, e.g. ``asset_path("corpus", "tinyshakespeare.txt")``."""
    return ASSETS_DIR.joinpath(*parts)


# Pre-tokenisation regexes, exactly as tiktoken / Meta define them.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)

END_OF_TEXT = "<|end_of_text|>"
BEGIN_OF_TEXT = "<|begin_of_text|>"
# Specials appended after the ranks of "test" and of any user rank file: eos first (so that
# eos = number of ranks), then bos, then reserved slots for later use (chat headers, FIM, ...).
NUM_RESERVED_SPECIALS = 6
_GENERIC_SPECIALS = (END_OF_TEXT, BEGIN_OF_TEXT) + tuple(
    f"<|reserved_special_token_{i}|>" for i in range(NUM_RESERVED_SPECIALS)
)

# name -> (rank file, pattern, special tokens or None for the generic layout, eos token, bos token)
_NAMED = {
    "gpt2": ("r50k_base.tiktoken", GPT2_PATTERN, {"<|endoftext|>": 50256}, "<|endoftext|>", None),
    "cl100k": (
        "cl100k_base.tiktoken",
        CL100K_PATTERN,
        {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
        "<|endoftext|>",
        None,
    ),
    "test": ("test_2k.tiktoken", LLAMA3_PATTERN, None, END_OF_TEXT, BEGIN_OF_TEXT),
}
TOKENIZER_NAMES = tuple(_NAMED)


class Tokenizer(SpecialTokens):
    """A tiktoken `Encoding` plus the few ids a trainer needs.

    `encode` never interprets special-token strings found in the text: "<|endoftext|>" inside a
    document is encoded as ordinary text, so user data can never inject control tokens.
    """

    def __init__(
        self,
        name: str,
        encoding: tiktoken.Encoding,
        eos_token: str,
        bos_token: str | None = None,
        source: str | None = None,
    ):
        self.name = name
        self.source = source or name  # what build_tokenizer rebuilds it from: the name, or the rank file's path
        self.encoding = encoding
        self.special_tokens: dict[str, int] = dict(
            sorted(((t, encoding.encode_single_token(t)) for t in encoding.special_tokens_set), key=lambda kv: kv[1])
        )
        self.eos_id: int = self.special_tokens[eos_token]
        self.bos_id: int | None = self.special_tokens[bos_token] if bos_token is not None else None
        self.vocab_size: int = encoding.n_vocab  # every id in [0, vocab_size) is a rank or a special
        self.fingerprint: str | None = None  # tiktoken tokenizers are told apart by name (HFTokenizer: by content)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.encoding.encode_ordinary(text)
        return self.wrap(ids, bos, eos)

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int | None = None
    ) -> list[list[int]]:
        """`encode` over many documents, in parallel threads (tiktoken releases the GIL)."""
        threads = num_threads or min(8, os.cpu_count() or 1)
        batch = self.encoding.encode_ordinary_batch(list(texts), num_threads=threads)
        return [self.wrap(ids, bos, eos) for ids in batch]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id})"


def build_tokenizer(name_or_path: str, pattern: str | None = None):
    """Build "gpt2", "cl100k", "test" (2,000 ranks, for fast tests), a tokenizer from a .tiktoken file, or a Hugging
    Face tokenizer from a folder holding tokenizer.json (or that file): an `HFTokenizer`.

    A rank file given by path uses the Llama-3 pattern unless `pattern` says otherwise, and gets
    the special tokens <|end_of_text|> (= eos, the first id after the ranks), <|begin_of_text|>
    (= bos) and a few reserved ones. "test" is exactly that layout over the shipped test_2k file.
    """
    if name_or_path in _NAMED:
        if pattern is None:
            return _named_tokenizer(name_or_path)
        filename, _, specials, eos, bos = _NAMED[name_or_path]
        return _build(name_or_path, asset_path("tokenizers", filename), pattern, specials, eos, bos)
    path = Path(name_or_path).expanduser()
    if hf_tokenizer_file(path) is not None:
        if pattern is not None:
            raise ValueError(f"{name_or_path} is a Hugging Face tokenizer: its pattern is in tokenizer.json")
        return HFTokenizer(path)
    if path.is_dir():
        raise ValueError(
            f"tokenizer folder {name_or_path!r} holds no tokenizer.json; a Hugging Face tokenizer folder has "
            f"tokenizer.json (and tokenizer_config.json)"
        )
    if not path.is_file():
        raise ValueError(
            f"tokenizer {name_or_path!r} is neither a known name ({', '.join(TOKENIZER_NAMES)}) "
            f"nor an existing .tiktoken rank file or Hugging Face tokenizer folder (tokenizer.json); use one of "
            f"those names or fix the path"
        )
    tok = _build(path.stem, path, pattern or LLAMA3_PATTERN, None, END_OF_TEXT, BEGIN_OF_TEXT)
    tok.source = str(path.resolve())
    return tok


def _build(
    name: str, path: Path, pattern: str, specials: dict[str, int] | None, eos: str, bos: str | None
) -> Tokenizer:
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    except (ValueError, OSError) as e:  # malformed lines raise ValueError / binascii.Error
        raise ValueError(f"cannot read tiktoken rank file {path} ({e}); it must hold 'base64(token) rank' lines") from e
    if not ranks:
        raise ValueError(f"tiktoken rank file {path} is empty; it must hold 'base64(token) rank' lines")
    if specials is None:
        first = max(ranks.values()) + 1
        specials = {tok: first + i for i, tok in enumerate(_GENERIC_SPECIALS)}
    encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(name, encoding, eos, bos)


@functools.cache
def _named_tokenizer(name: str) -> Tokenizer:
    """The shipped tokenizers are built once per process (cl100k takes a quarter of a second)."""
    filename, pattern, specials, eos, bos = _NAMED[name]
    return _build(name, asset_path("tokenizers", filename), pattern, specials, eos, bos)
