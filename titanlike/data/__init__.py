"""Offline data pipeline: tokenizers from local rank files, token streams, packed windows, and
data-parallel loaders whose order and resume position do not depend on the parallel layout."""

from titanlike.data.check import check_length, check_sources
from titanlike.data.datasets import (
    PackedWindows,
    iter_token_chunks,
    load_token_stream,
    open_token_file,
    sidecar_path,
    split_stream,
    token_dtype,
    write_token_file,
)
from titanlike.data.loader import (
    GlobalSampleStream,
    TokenDataLoader,
    build_dataloader,
    build_validation_loader,
    loader_position,
    set_loader_position,
)
from titanlike.data.tokenizer import TOKENIZER_NAMES, Tokenizer, asset_path, build_tokenizer


def shipped_corpus() -> list[str]:
    """The corpus shipped in titanlike/assets, as `load_token_stream` paths: tinyshakespeare, then 13 books."""
    return [str(asset_path("corpus", "tinyshakespeare.txt")), str(asset_path("corpus", "gutenberg"))]


__all__ = [
    "GlobalSampleStream",
    "PackedWindows",
    "TOKENIZER_NAMES",
    "TokenDataLoader",
    "Tokenizer",
    "asset_path",
    "build_dataloader",
    "build_tokenizer",
    "build_validation_loader",
    "check_length",
    "check_sources",
    "iter_token_chunks",
    "load_token_stream",
    "loader_position",
    "open_token_file",
    "set_loader_position",
    "shipped_corpus",
    "sidecar_path",
    "split_stream",
    "token_dtype",
    "write_token_file",
]
