"""Offline data pipeline: tokenizers (tiktoken rank files, Hugging Face tokenizer.json), the formats corpora ship in,
pre-tokenized shards indexed and never concatenated, weighted mixtures, packed windows, and data-parallel loaders
whose order and resume position do not depend on the parallel layout."""

from titanlike.data.check import check_length, check_sources
from titanlike.data.corpus import Corpus, Source, build_corpus
from titanlike.data.datasets import (
    PackedWindows,
    iter_token_chunks,
    load_token_stream,
    open_token_file,
    open_tokens,
    sidecar_path,
    split_stream,
    token_dtype,
    write_token_file,
)
from titanlike.data.hf_tokenizer import HFTokenizer
from titanlike.data.loader import (
    GlobalSampleStream,
    TokenDataLoader,
    build_dataloader,
    build_validation_loader,
    loader_position,
    set_loader_position,
)
from titanlike.data.mixture import Blend, BlendedWindows
from titanlike.data.shards import ShardInfo, TokenShards, TokenWriter, index_token_file
from titanlike.data.tokenizer import TOKENIZER_NAMES, Tokenizer, asset_path, build_tokenizer


def shipped_corpus() -> list[str]:
    """The corpus shipped in titanlike/assets, as `load_token_stream` paths: tinyshakespeare, then 13 books."""
    return [str(asset_path("corpus", "tinyshakespeare.txt")), str(asset_path("corpus", "gutenberg"))]


__all__ = [
    "Blend",
    "BlendedWindows",
    "Corpus",
    "GlobalSampleStream",
    "HFTokenizer",
    "PackedWindows",
    "ShardInfo",
    "Source",
    "TOKENIZER_NAMES",
    "TokenDataLoader",
    "TokenShards",
    "TokenWriter",
    "Tokenizer",
    "asset_path",
    "build_corpus",
    "build_dataloader",
    "build_tokenizer",
    "build_validation_loader",
    "check_length",
    "check_sources",
    "index_token_file",
    "iter_token_chunks",
    "load_token_stream",
    "loader_position",
    "open_token_file",
    "open_tokens",
    "set_loader_position",
    "shipped_corpus",
    "sidecar_path",
    "split_stream",
    "token_dtype",
    "write_token_file",
]
