"""The file formats corpora ship in, read as a stream of documents with bounded memory.

=====================================  ==========================================================================
``.txt``                               one document (the whole file, decoded with ``data.encoding``)
``.jsonl``                             JSON lines: one document per line, its text under ``text_field``
``.jsonl.gz`` / ``.json.gz``           the same, gzip-compressed (C4, Dolma)
``.jsonl.zst`` / ``.json.zst``         the same, zstandard-compressed, any number of frames (the Pile)
``.parquet``                           one document per row of the string column ``text_field``, read one row
                                       group at a time with pyarrow (FineWeb, FineWeb-Edu, DCLM)
``.bin``                               pre-tokenized tokens (scripts/preprocess_data.py), see shards.py
=====================================  ==========================================================================

A source is a file, a folder (its files of these formats, in sorted name order, not recursed) or a glob
(``data/c4/*.json.gz``, sorted). Compressed files are decompressed as they are read (gzip by the standard library,
zstandard by ``zstandard``); nothing holds more than one document, one line or one parquet row group. Every reader
raises a ``ValueError`` naming the file (and the line or row) on bad content, which ``check.py`` reports up front.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

# name ending -> (format, compression); longest endings first
SUFFIXES: dict[str, tuple[str, str | None]] = {
    ".jsonl.gz": ("jsonl", "gzip"),
    ".json.gz": ("jsonl", "gzip"),
    ".jsonl.zst": ("jsonl", "zstd"),
    ".json.zst": ("jsonl", "zstd"),
    ".jsonl": ("jsonl", None),
    ".parquet": ("parquet", None),
    ".txt": ("text", None),
    ".bin": ("bin", None),
}
FORMATS_TEXT = "a .txt, .jsonl, .jsonl.gz / .json.gz, .jsonl.zst / .json.zst, .parquet or .bin file"
_READ = 1 << 20  # bytes read from a compressed file at a time
_GLOB_CHARS = "*?["


def file_kind(path: str | os.PathLike) -> tuple[str, str | None] | None:
    """(format, compression) of a data file by its name, or None for a file no reader handles."""
    name = os.fspath(path).lower()
    for ending, kind in SUFFIXES.items():
        if name.endswith(ending):
            return kind
    return None


def is_glob(entry: str | os.PathLike) -> bool:
    return any(c in os.fspath(entry) for c in _GLOB_CHARS)


def folder_files(folder: Path) -> list[Path]:
    """The data files of a folder: every file of a known format, sorted by name (sidecars, other files ignored)."""
    return sorted(f for f in folder.iterdir() if f.is_file() and file_kind(f) is not None)


def expand_entry(entry: str | os.PathLike) -> tuple[list[Path], str | None]:
    """The files of one source entry (a file, a folder or a glob) and the problem with it, if any."""
    text = os.path.expanduser(os.fspath(entry))
    if is_glob(text):
        matches = sorted(Path(m) for m in glob.glob(text) if Path(m).is_file() and file_kind(m) is not None)
        if not matches:
            return [], f"data path glob {text} matches no data file ({FORMATS_TEXT})"
        return matches, None
    p = Path(text)
    if p.is_dir():
        found = folder_files(p)
        if not found:
            others = sorted(f.name for f in p.iterdir())[:3]
            return [], (
                f"data folder {p} holds no .txt or .jsonl files (nor .jsonl.gz, .json.gz, .jsonl.zst, .json.zst, "
                f".parquet or .bin)" + (f" (it has {', '.join(others)})" if others else " (it is empty)")
            )
        return found, None
    if p.is_file():
        if file_kind(p) is None:
            return [], f"data file {p} is not {FORMATS_TEXT}; rename or convert it"
        return [p], None
    return [], f"data path {p} does not exist"


def skipped_files(entry: str | os.PathLike) -> list[tuple[Path, str]]:
    """What a folder or glob entry holds that is not read, each with why: files of no known format (by their name's
    ending), sub-folders (not recursed); a ``.bin``'s sidecar is part of the shard, not skipped."""
    text = os.path.expanduser(os.fspath(entry))
    if is_glob(text):
        candidates = sorted(Path(m) for m in glob.glob(text))
    elif Path(text).is_dir():
        candidates = sorted(Path(text).iterdir())
    else:
        return []
    names = {c.name for c in candidates}
    out = []
    for c in candidates:
        if c.is_dir():
            out.append((c, "a folder: not recursed"))
        elif c.is_file() and file_kind(c) is None:
            if c.name.endswith(".bin.json") and c.name[: -len(".json")] in names:
                continue  # the sidecar of a .bin shard
            ending = "".join(c.suffixes[-2:]) if c.suffixes else ""
            out.append((c, f"{ending or 'no ending'}: no reader" if not c.name.startswith(".") else "hidden"))
    return out


def describe_entries(paths: Sequence[str | os.PathLike], limit: int = 4) -> str:
    """One line of what a run reads: per entry, the files used and those skipped (with why), named up to ``limit``
    each."""

    def names(items: list[str]) -> str:
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more

    parts = []
    for entry in paths:
        used, _ = expand_entry(entry)
        skipped = skipped_files(entry)
        part = f"{entry}: {len(used)} file{'s' if len(used) != 1 else ''}"
        if is_glob(os.fspath(entry)) or Path(os.fspath(entry)).is_dir():
            part += f" ({names([u.name for u in used])})"
        if skipped:
            part += f", {len(skipped)} skipped ({names([f'{p.name} ({why})' for p, why in skipped])})"
        parts.append(part)
    line = "; ".join(parts)
    if any(skipped_files(e) for e in paths):
        line += f"; read: {', '.join(SUFFIXES)} (rename a text file to .txt to train on it)"
    return line


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Every data file of `paths` (one entry or a list), in order; a ValueError names the first bad entry."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError(f"no data path given; pass {FORMATS_TEXT}, a folder of them or a glob")
    files: list[Path] = []
    for entry in paths:
        found, problem = expand_entry(entry)
        if problem:
            raise ValueError(f"{problem}; pass an existing file, folder or glob")
        files += found
    return files


# ---------------------------------------------------------------------------------------------
# Decompression


class _ChunkStream(io.RawIOBase):
    """A readable raw stream over an iterator of byte chunks (so that io.BufferedReader splits it into lines)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._buf = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            self._buf = next(self._chunks, b"")
            if not self._buf:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def _zstd_chunks(f, path: Path) -> Iterator[bytes]:
    """The decompressed bytes of every zstandard frame of `f`; a frame cut short (a truncated file) raises."""
    import zstandard

    new = zstandard.ZstdDecompressor().decompressobj
    d, open_frame = new(), False
    while chunk := f.read(_READ):
        while chunk:
            try:
                out = d.decompress(chunk)
            except zstandard.ZstdError as e:
                raise ValueError(f"{path} is not a valid zstandard file ({e})") from None
            open_frame = True
            if out:
                yield out
            if d.eof:  # the frame ended: the rest is the next frame
                chunk, d, open_frame = d.unused_data, new(), False
            else:
                chunk = b""
    if open_frame:
        raise ValueError(f"{path} is truncated: its last zstandard frame ends before its end marker")


@contextlib.contextmanager
def open_binary(path: Path, compression: str | None):
    """The decompressed bytes of `path` as a buffered binary stream (iterate it for lines)."""
    with open(path, "rb") as raw:
        if compression is None:
            yield raw
        elif compression == "gzip":
            with gzip.GzipFile(fileobj=raw) as f:
                yield io.BufferedReader(f, _READ)
        else:
            yield io.BufferedReader(_ChunkStream(_zstd_chunks(raw, path)), _READ)


def decompression_error(path: Path, e: BaseException) -> str | None:
    """The one-line problem for an error raised while decompressing `path`, or None if it is not one."""
    if isinstance(e, gzip.BadGzipFile):
        return f"{path} is not a valid gzip file ({e})"
    if isinstance(e, EOFError):
        return f"{path} is truncated: the gzip stream ends before its end marker"
    if isinstance(e, zlib.error):
        return f"{path} is a corrupt gzip file ({e})"
    return None


def iter_lines(path: Path, compression: str | None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a possibly compressed file; decompression problems as one-line ValueErrors."""
    try:
        with open_binary(path, compression) as f:
            yield from enumerate(f, 1)
    except (OSError, EOFError, zlib.error) as e:
        why = decompression_error(path, e)
        if why is None:
            raise
        raise ValueError(why) from None


# ---------------------------------------------------------------------------------------------
# Documents


def is_utf8(encoding: str) -> bool:
    return encoding.replace("_", "-").lower() in ("utf-8", "utf8")


def encoding_fix(encoding: str) -> str:
    """How to read a file that does not decode with `encoding`."""
    if is_utf8(encoding):
        return (
            "convert it (iconv -f latin1 -t utf-8), or read it on purpose with data.encoding = 'latin-1' or "
            "data.encoding_errors = 'replace'"
        )
    return "convert it, set the right data.encoding, or data.encoding_errors = 'replace'"


def decode_text(data: bytes, path: Path, encoding: str = "utf-8", errors: str = "strict") -> str:
    """The text of a .txt file's bytes (a UTF-8 byte-order mark dropped); a ValueError names the bad byte."""
    try:
        return data.decode("utf-8-sig" if is_utf8(encoding) else encoding, errors)
    except UnicodeDecodeError as e:
        what = "UTF-8" if is_utf8(encoding) else f"{encoding} text"
        raise ValueError(f"{path} is not {what} (bad byte at offset {e.start}); {encoding_fix(encoding)}") from None


def read_text(path: Path, encoding: str = "utf-8", errors: str = "strict") -> str:
    """A .txt file as one document."""
    return decode_text(path.read_bytes(), path, encoding, errors)


def jsonl_record(line: bytes, text_field: str, encoding: str, errors: str) -> tuple[str | None, str | None]:
    """(text, None) of one JSON line, or (None, why it is bad: a phrase that follows the line's number)."""
    try:
        record = json.loads(line if is_utf8(encoding) else line.decode(encoding, errors))
    except UnicodeDecodeError as e:
        return None, f" is not {encoding} text (offset {e.start} of the line); {encoding_fix(encoding)}"
    except ValueError as e:
        return None, f" is not a JSON object ({getattr(e, 'msg', e)})"
    if not isinstance(record, dict):
        return None, (
            f" has no {text_field!r} field; set text_field to the key that holds the document text (the line is a "
            f"JSON {type(record).__name__}, not an object)"
        )
    if text_field not in record:
        return None, f" has no {text_field!r} field (keys: {', '.join(list(record)[:5])}); set data.text_field"
    text = record[text_field]
    if not isinstance(text, str):
        return None, f": field {text_field!r} is a {type(text).__name__}, not a string; set data.text_field"
    return text, None


def _jsonl_documents(path: Path, compression, text_field: str, encoding: str, errors: str) -> Iterator[str]:
    for lineno, line in iter_lines(path, compression):
        if not line.strip():
            continue
        text, why = jsonl_record(line, text_field, encoding, errors)
        if why:
            raise ValueError(f"{path}:{lineno}{why}")
        yield text


def parquet_column(path: Path, text_field: str):
    """(ParquetFile, column index) of the string column `text_field`; a ValueError names what is wrong."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(
            f"{path} has no column {text_field!r} (columns: {', '.join(schema.names[:8])}); set data.text_field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise ValueError(f"{path}: column {text_field!r} holds {kind}, not strings; set data.text_field")
    return pf, schema.get_field_index(text_field)


def parquet_row_groups(path: Path, text_field: str) -> Iterator[tuple[int, list]]:
    """(first row, the column's values) of each row group of `path`, one row group in memory at a time."""
    import pyarrow as pa

    pf, _ = parquet_column(path, text_field)
    first = 0
    for i in range(pf.metadata.num_row_groups):
        try:
            values = pf.read_row_group(i, columns=[text_field]).column(0).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {i} cannot be read ({e})") from None
        yield first, values
        first += len(values)


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    for first, values in parquet_row_groups(path, text_field):
        for j, text in enumerate(values):
            if text is None:
                raise ValueError(f"{path}: row {first + j} has a null {text_field!r}; drop or fill the null rows")
            yield text


def iter_documents(path: Path, text_field: str = "text", encoding: str = "utf-8", errors: str = "strict"):
    """The documents of one data file (not a .bin), in order, streamed."""
    kind = file_kind(path)
    if kind is None or kind[0] == "bin":
        raise ValueError(f"{path} holds no documents (it is not {FORMATS_TEXT} other than .bin)")
    fmt, compression = kind
    if fmt == "text":
        return iter([read_text(path, encoding, errors)])
    if fmt == "jsonl":
        return _jsonl_documents(path, compression, text_field, encoding, errors)
    return _parquet_documents(path, text_field)
