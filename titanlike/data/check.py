"""Data files as they come: every problem of every source file, found before anything starts.

``check_sources`` reads each file once (no tokenizing) and returns one line per bad file — an empty file or folder,
binary bytes, text that does not decode with ``data.encoding``, a ``.jsonl`` line that is not a JSON object or lacks
the text field, a ``.bin`` that is truncated, lacks its sidecar or was made with another tokenizer. The trainer
reports them all in one error (exit code 2) before any process group starts; ``check_length`` then compares the
token count with ``seq_len``.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Sequence
from pathlib import Path

from titanlike.data.datasets import TEXT_SUFFIXES, open_token_file
from titanlike.data.tokenizer import Tokenizer

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


def _fix(encoding: str) -> str:
    if encoding.replace("_", "-").lower() in ("utf-8", "utf8"):
        return (
            "convert it (iconv -f latin1 -t utf-8), or read it on purpose with data.encoding = 'latin-1' or "
            "data.encoding_errors = 'replace'"
        )
    return "convert it, set the right data.encoding, or data.encoding_errors = 'replace'"


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
        data.decode(encoding if encoding.replace("_", "-").lower() not in ("utf-8", "utf8") else "utf-8-sig", errors)
    except UnicodeDecodeError as e:
        what = "UTF-8" if encoding.replace("_", "-").lower() in ("utf-8", "utf8") else f"{encoding} text"
        return f"{path} is not {what} (byte {data[e.start]:#04x} at offset {e.start}); {_fix(encoding)}"
    return None


def _check_jsonl(path: Path, text_field: str, encoding: str, errors: str) -> str | None:
    bad, first, docs = 0, None, 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            why = None
            try:
                record = json.loads(
                    line.decode(encoding, errors) if encoding.lower() not in ("utf-8", "utf8") else line
                )
            except UnicodeDecodeError as e:
                why = f"is not {encoding} text (offset {e.start} of the line); {_fix(encoding)}"
            except ValueError as e:
                why = f"is not a JSON object ({e.msg})"
            else:
                if not isinstance(record, dict):
                    why = f"is a JSON {type(record).__name__}, not an object"
                elif text_field not in record:
                    why = f"has no {text_field!r} field (keys: {', '.join(list(record)[:5])}); set data.text_field"
                elif not isinstance(record[text_field], str):
                    why = f"field {text_field!r} is a {type(record[text_field]).__name__}, not a string"
            if why is not None:
                bad += 1
                first = first or f"line {lineno} {why}"
            else:
                docs += 1
    if first:
        return f"{path}: {bad} bad line(s), the first: {first}"
    if docs == 0:
        return f"{path} is empty (no JSON lines)"
    return None


def check_sources(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> list[str]:
    """One line per bad source file or folder (all of them); [] when every file can be read."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    problems: list[str] = []
    files: list[Path] = []
    for p in (Path(x).expanduser() for x in paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                others = sorted(f.name for f in p.iterdir())[:3]
                problems.append(
                    f"data folder {p} holds no .txt or .jsonl files"
                    + (f" (it has {', '.join(others)})" if others else " (it is empty)")
                )
            files += found
        elif p.is_file():
            files.append(p)
        else:
            problems.append(f"data path {p} does not exist")
    for f in files:
        try:
            if f.suffix == ".bin":
                why = None
                try:
                    if len(open_token_file(f, tokenizer)) == 0:
                        why = f"{f} holds no tokens"
                except ValueError as e:
                    why = str(e)
            elif f.suffix == ".jsonl":
                why = _check_jsonl(f, text_field, encoding, errors)
            else:
                why = _check_text(f, encoding, errors)
        except OSError as e:
            why = f"{f} cannot be read ({e.strerror or e})"
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
