"""Token streams and packed training windows.

Every source becomes one flat token stream: documents, each followed by the tokenizer's EOS, laid
end to end. Sources are plain text (a file, or a folder whose .txt/.jsonl files are read in sorted
name order; a text file is one document), JSON lines (one document per line, text under
`text_field`) and pre-tokenised ``.bin`` files written by scripts/preprocess_data.py (raw
little-endian uint16/uint32 tokens plus a ``<file>.json`` sidecar), which are memory-mapped.

`PackedWindows` cuts a stream into windows of seq_len + 1 tokens with stride seq_len, and fixes
the order in which they are read as a pure function of (global sample index, seed): global sample
g lies in epoch g // n_windows and is window perm(seed, epoch)[g % n_windows]. Nothing here knows
about data-parallel ranks; the loader only decides which global samples a rank reads.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from titanlike.data.tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".jsonl")  # what a folder source contributes; anything else in it is ignored
SIDECAR_FORMAT = "titanlike-tokens"
SIDECAR_VERSION = 1
_BATCH_CHARS = 32 << 20  # tokenize documents in batches of about this many characters


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(bin_path)}.json")


# ---------------------------------------------------------------------------------------------
# Sources -> token stream


def _source_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no data path given; pass a text/.jsonl/.bin file or a folder of .txt/.jsonl files")
    files: list[Path] = []
    for p in (Path(x).expanduser() for x in paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise ValueError(f"data folder {p} holds no .txt or .jsonl files; point at one that does, or at a file")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"data path {p} does not exist; pass an existing text/.jsonl/.bin file or folder")
    return files


def _utf8(encoding: str) -> bool:
    return encoding.replace("_", "-").lower() in ("utf-8", "utf8")


def _read_utf8(path: Path, encoding: str = "utf-8", errors: str = "strict") -> str:
    try:
        return path.read_bytes().decode("utf-8-sig" if _utf8(encoding) else encoding, errors)
    except UnicodeDecodeError as e:
        what = "UTF-8" if _utf8(encoding) else f"{encoding} text"
        raise ValueError(
            f"{path} is not {what} (bad byte at offset {e.start}); convert it, "
            f"e.g. iconv -f latin1 -t utf-8, or set data.encoding"
        ) from None


def _jsonl_documents(path: Path, text_field: str, encoding: str = "utf-8", errors: str = "strict") -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line if _utf8(encoding) else line.decode(encoding, errors))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(
                    f"{path}:{lineno} is not a JSON object ({e}); each line of a .jsonl file must be one JSON object"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(
                    f"{path}:{lineno} has no {text_field!r} field; set text_field to the key "
                    f"that holds the document text"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string; "
                    f"set text_field to the key that holds the document text"
                )
            yield text


def iter_token_chunks(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> Iterator[np.ndarray]:
    """The token stream of `paths`, in order, as consecutive chunks (memory-mapped for .bin files).

    Text and JSON lines are decoded with `encoding` and the `errors` policy ('strict', 'replace', 'ignore').

    Each non-empty document contributes its tokens followed by ``tokenizer.eos_id``; empty
    documents contribute nothing.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    pending: list[str] = []
    pending_chars = 0

    def flush() -> Iterator[np.ndarray]:
        nonlocal pending_chars
        if pending:
            ids = tokenizer.encode_batch(pending, eos=True)
            pending.clear()
            pending_chars = 0
            yield np.concatenate([np.asarray(doc, dtype=dtype) for doc in ids])

    for path in _source_files(paths):
        if path.suffix == ".bin":
            yield from flush()
            yield open_token_file(path, tokenizer)
            continue
        docs = (
            _jsonl_documents(path, text_field, encoding, errors)
            if path.suffix == ".jsonl"
            else [_read_utf8(path, encoding, errors)]
        )
        for doc in docs:
            if doc:
                pending.append(doc)
                pending_chars += len(doc)
                if pending_chars >= _BATCH_CHARS:
                    yield from flush()
    yield from flush()


def load_token_stream(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    text_field: str = "text",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> np.ndarray:
    """All documents of `path` (one source or a list of them) as one flat token array.

    The dtype is uint16 for vocabularies up to 65,536 ids, else uint32. A single .bin source is
    returned as a read-only np.memmap, so a large pre-tokenised corpus is never read into memory.
    """
    chunks = [c for c in iter_token_chunks(path, tokenizer, text_field, encoding, errors) if len(c)]
    if not chunks:
        raise ValueError(f"data path {path} holds no text; point it at non-empty documents")
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


# ---------------------------------------------------------------------------------------------
# Pre-tokenised .bin files


def write_token_file(chunks: Iterable[np.ndarray], out_path: str | os.PathLike, tokenizer: Tokenizer) -> int:
    """Write a token stream to `out_path` (.bin) and its JSON sidecar, atomically; returns the token count.

    Both files are written to temporary names in the destination folder and renamed into place,
    the .bin first: a reader never sees a partial file, and `open_token_file` rejects a .bin whose
    size disagrees with its sidecar.
    """
    out = Path(out_path)
    if out.suffix != ".bin":
        raise ValueError(f"output {out} must end in .bin")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size).newbyteorder("<")
    n_tokens = 0
    tmp_bin = tmp_json = None
    try:
        with tempfile.NamedTemporaryFile("wb", dir=out.parent, prefix=f".{out.name}.", delete=False) as f:
            tmp_bin = f.name
            for chunk in chunks:
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                n_tokens += len(chunk)
            if n_tokens == 0:
                raise ValueError(f"nothing to write to {out}: the inputs hold no text")
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "format": SIDECAR_FORMAT,
            "version": SIDECAR_VERSION,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "n_tokens": n_tokens,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        }
        with tempfile.NamedTemporaryFile(
            "w", dir=out.parent, prefix=f".{out.name}.", suffix=".json", delete=False
        ) as f:
            tmp_json = f.name
            json.dump(meta, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        mode = 0o666 & ~_umask()  # mkstemp's files are private (0600); give the outputs ordinary permissions
        os.chmod(tmp_bin, mode)
        os.chmod(tmp_json, mode)
        os.replace(tmp_bin, out)
        tmp_bin = None
        os.replace(tmp_json, sidecar_path(out))
        tmp_json = None
    finally:
        for tmp in (tmp_bin, tmp_json):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return n_tokens


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_token_file(path: str | os.PathLike, tokenizer: Tokenizer) -> np.ndarray:
    """Memory-map a .bin written by `write_token_file`, checking it was made with `tokenizer`."""
    path = Path(path)
    side = sidecar_path(path)
    fix = f"re-run scripts/preprocess_data.py --tokenizer {tokenizer.name} --output {path}"
    if not side.is_file():
        raise ValueError(f"{path} has no sidecar {side}; {fix}")
    try:
        meta = json.loads(side.read_text())
        dtype, n_tokens = np.dtype(meta["dtype"]), int(meta["n_tokens"])
        made_with = (meta["tokenizer"], int(meta["vocab_size"]), int(meta["eos_id"]))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"sidecar {side} is unreadable ({e!r}); {fix}") from None
    if made_with != (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id):
        raise ValueError(
            f"{path} was tokenized with {made_with[0]!r} (vocab {made_with[1]}, eos {made_with[2]}) but "
            f"this run uses {tokenizer.name!r} (vocab {tokenizer.vocab_size}, eos {tokenizer.eos_id}); "
            f"use that tokenizer or {fix}"
        )
    if dtype != token_dtype(tokenizer.vocab_size) or path.stat().st_size != n_tokens * dtype.itemsize:
        raise ValueError(
            f"{path} holds {path.stat().st_size} bytes, not the {n_tokens} {dtype} tokens its sidecar "
            f"promises (truncated or overwritten); {fix}"
        )
    if n_tokens == 0:
        return np.empty(0, dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(n_tokens,))


# ---------------------------------------------------------------------------------------------
# Splitting and packing


def split_stream(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) views of `tokens`: validation is the last floor(len * val_fraction) tokens."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]


class PackedWindows(torch.utils.data.Dataset):
    """Windows of seq_len + 1 tokens at stride seq_len; inputs = w[:-1], labels = w[1:].

    ``windows[i]`` is window i in storage order. The training order is global: `window_index(g)`
    maps a global sample index g (0, 1, 2, ... forever) to a window, epoch by epoch, through a
    permutation seeded by (seed, epoch) when `shuffle` is set. It never depends on how many ranks
    or workers read the samples.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a flat 1-D array, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = int(seed)
        self.shuffle = shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of seq_len + 1 = {seq_len + 1} tokens; "
                f"use more data or a shorter seq_len"
            )
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n_windows:
            raise IndexError(f"window {i} out of range [0, {self.n_windows})")
        inputs, labels = self.batch_windows(np.array([i]))
        return inputs[0], labels[0]

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of `epoch` (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.n_windows)
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch rarely spans more than two epochs; keep the cache small
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def window_indices(self, global_samples: Iterable[int]) -> np.ndarray:
        """The windows read as the given global samples."""
        g = np.fromiter(global_samples, dtype=np.int64)
        if (g < 0).any():
            raise IndexError(f"global sample indices must be >= 0, got {g.min()}")
        epoch, i = np.divmod(g, self.n_windows)
        if not self.shuffle:
            return i
        out = np.empty_like(i)
        for e in np.unique(epoch):
            in_e = epoch == e
            out[in_e] = self.permutation(int(e))[i[in_e]]
        return out

    def window_index(self, g: int) -> int:
        """The window read as global sample `g`."""
        return int(self.window_indices([g])[0])

    def sample(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of global sample `g`."""
        return self[self.window_index(g)]

    def batch(self, global_samples: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked (inputs, labels) of the given global samples, each LongTensor[n, seq_len]."""
        return self.batch_windows(self.window_indices(global_samples))

    def batch_windows(self, window_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = window_ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        w = torch.from_numpy(self.tokens[rows].astype(np.int64))
        return w[:, :-1], w[:, 1:]

    # A token array memory-mapped from a .bin travels to DataLoader workers as (file, offset,
    # length), not as a pickled copy of its contents.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_perms"] = {}
        ref = _memmap_reference(self.tokens)
        if ref is not None:
            state["tokens"] = ref
        return state

    def __setstate__(self, state: dict) -> None:
        ref = state["tokens"]
        if isinstance(ref, tuple):
            filename, dtype, offset, length = ref
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


def _memmap_reference(a: np.ndarray) -> tuple[str, str, int, int] | None:
    """(file, dtype, byte offset, length) if `a` is a contiguous, non-empty 1-D view of a file mapping."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not (isinstance(root, np.memmap) and root.filename and a.ndim == 1 and len(a) and a.flags.c_contiguous):
        return None
    offset = root.offset + (a.__array_interface__["data"][0] - root.__array_interface__["data"][0])
    return root.filename, a.dtype.str, offset, len(a)
