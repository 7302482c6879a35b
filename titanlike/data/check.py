"""Data files as they come: every problem of every source file, found before anything starts.

``check_sources`` reads each file once (no tokenizing) and returns one line per bad file — an empty file or folder,
a glob that matches nothing, binary bytes, text that does not decode with ``data.encoding``, a JSON line that is not
a JSON object or lacks the text field, a gzip / zstandard file that is corrupt or truncated, a parquet file that is
unreadable, lacks the text column or holds nulls in it, a ``.bin`` that is truncated, lacks its sidecar, was made
with another tokenizer or holds ids outside the vocabulary (its sidecar's min/max, verified on a sample). The
trainer reports them all in one error (exit code 2) before any process group starts; ``check_length`` then compares
the token count with ``seq_len``.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from pathlib import Path

from titanlike.data.formats import (
    encoding_fix,
    expand_entry,
    file_kind,
    is_utf8,
    iter_lines,
    jsonl_record,
    parquet_row_groups,
)
from titanlike.data.shards import index_token_file

ERRORS_POLICIES = ("strict", "replace", "ignore")
_SNIFF = 1 << 16  # bytes looked at for NUL bytes (binary files)


def check_encoding(encoding: str, errors: str) -> str | None:
    """None if ``encoding`` / ``errors`` are usable, else the problem."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        return f"data.encoding: '{encoding}' is not a text encoding Python knows (e.g. utf-8, latin-1, cp1252)"
    if errors not in ERRORS_POLICIES:
        return f"data.encoding_errors: '{errors}' is not one of {', '.join(ERRORS_POLICIES)}"
    return None


def _check_text(path: Path, encoding: str, errors: str) -> str | None:
    data = path.read_bytes()
    if not data.strip():
        return f"{path} is empty"
    if (
        b"\x00" in data[:_SNIFF]
        and not encoding.lower().startswith("utf-16")
        and not encoding.lower().startswith("utf-32")
    ):
        return f"{path} holds NUL bytes: binary data, not text (a .bin must come from scripts/preprocess_data.py)"
    try:
        data.decode(encoding if not is_utf8(encoding) else "utf-8-sig", errors)
    except UnicodeDecodeError as e:
        what = "UTF-8" if is_utf8(encoding) else f"{encoding} text"
        return f"{path} is not {what} (byte {data[e.start]:#04x} at offset {e.start}); {encoding_fix(encoding)}"
    return None


def _check_jsonl(path: Path, compression: str | None, text_field: str, encoding: str, errors: str) -> str | None:
    bad, first, docs = 0, None, 0
    try:
        for lineno, line in iter_lines(path, compression):
            if not line.strip():
                continue
            _, why = jsonl_record(line, text_field, encoding, errors)
            if why is not None:
                bad += 1
                first = first or f"line {lineno}{why}"
            else:
                docs += 1
    except ValueError as e:  # corrupt or truncated compressed data
        return str(e) + (f" (and {bad} bad line(s) before, the first: {first})" if first else "")
    if first:
        return f"{path}: {bad} bad line(s), the first: {first}"
    if docs == 0:
        return f"{path} is empty (no JSON lines)"
    return None


def _check_parquet(path: Path, text_field: str) -> str | None:
    rows = nulls = 0
    first_null = None
    try:
        for first, values in parquet_row_groups(path, text_field):
            for j, v in enumerate(values):
                if v is None:
                    nulls += 1
                    first_null = first + j if first_null is None else first_null
            rows += len(values)
    except ValueError as e:
        return str(e)
    if nulls:
        return f"{path}: {nulls} row(s) with a null {text_field!r}, the first row {first_null}; drop or fill them"
    if rows == 0:
        return f"{path} is empty (no rows)"
    return None


def _check_bin(path: Path, tokenizer) -> str | None:
    try:
        if index_token_file(path, tokenizer).n_tokens == 0:
            return f"{path} holds no tokens"
    except ValueError as e:
        return str(e)
    return None


def check_file(path: Path, tokenizer, text_field: str = "text", encoding: str = "utf-8", errors: str = "strict"):
    """The problem of one data file (a readable file of a known format), or None."""
    fmt, compression = file_kind(path)
    try:
        if fmt == "bin":
            return _check_bin(path, tokenizer)
        if fmt == "jsonl":
            return _check_jsonl(path, compression, text_field, encoding, errors)
        if fmt == "parquet":
            return _check_parquet(path, text_field)
        return _check_text(path, encoding, errors)
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e})"


def check_sources(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> list[str]:
    """One line per bad source entry or file (all of them); [] when every file can be read."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    problems: list[str] = []
    files: list[Path] = []
    for entry in paths:
        found, problem = expand_entry(entry)
        if problem:
            problems.append(problem)
        files += found
    for f in files:
        why = check_file(f, tokenizer, text_field, encoding, errors)
        if why:
            problems.append(why)
    return problems


def check_length(n_tokens: int, seq_len: int, where: str) -> str | None:
    """The problem when ``n_tokens`` training tokens cannot fill one window of seq_len + 1."""
    if n_tokens < seq_len + 1:
        return (
            f"{where} holds {n_tokens:,} training tokens, fewer than one window of training.seq_len + 1 = "
            f"{seq_len + 1:,}; use more data, a shorter training.seq_len or a smaller data.val_fraction"
        )
    return None
