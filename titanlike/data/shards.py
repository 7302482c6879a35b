"""Pre-tokenized ``.bin`` shards and token streams made of many pieces, never concatenated.

A ``.bin`` holds raw little-endian uint16 / uint32 token ids; its ``<file>.bin.json`` sidecar records how it was made
(tokenizer name and, for a Hugging Face tokenizer, the SHA-256 of its tokenizer.json; vocabulary size, eos id), the
token count and, since version 2, the smallest and largest id it holds. A shard is *indexed* cheaply: the sidecar is
read, the file size checked against it, the largest id checked against the vocabulary, and the sidecar's min/max
verified on a sample of the file (a few blocks spread over it); a version-1 sidecar (no min/max) is verified by
reading the whole file once, in bounded chunks. Every problem is one line.

`TokenShards` is a flat token stream laid end to end from pieces (indexed shards, read with ``os.pread`` on demand,
and in-memory arrays of tokenized text): its memory is the index (a few numbers per piece) plus what one read
returns, whatever the corpus size. Windows are gathered across piece boundaries exactly as from the concatenation.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SIDECAR_FORMAT = "titanlike-tokens"
SIDECAR_VERSION = 2
SAMPLE_BLOCKS = 8  # blocks of a shard read to verify its sidecar's min/max ids
SAMPLE_BLOCK_TOKENS = 4096
_SCAN_TOKENS = 1 << 24  # chunk of a full scan (version-1 sidecars)
_OPEN_FILES = 64  # file descriptors a TokenShards keeps open (least recently used closed first)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(bin_path)}.json")


def tokenizer_identity(tokenizer) -> dict:
    """What a sidecar records of the tokenizer (and what a run's tokenizer must match)."""
    out = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    if getattr(tokenizer, "fingerprint", None):
        out["tokenizer_sha256"] = tokenizer.fingerprint
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json_atomic(path: Path, meta: dict) -> str:
    """Write ``meta`` to a temporary file next to ``path`` (fsynced); return its name (the caller renames it)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return f.name


class TokenWriter:
    """Streams token chunks into a ``.bin`` and commits it with its sidecar atomically.

    Both files are written under temporary names in the destination folder and renamed into place, the .bin
    first, only by `commit`; `abort` (or leaving a ``with`` block on an exception) removes them. A reader never sees
    a partial file, and `index_token_file` rejects a .bin whose size disagrees with its sidecar.
    """

    def __init__(self, out_path: str | os.PathLike, tokenizer):
        self.out = Path(out_path)
        if self.out.suffix != ".bin":
            raise ValueError(f"output {self.out} must end in .bin")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.n_tokens, self.min_id, self.max_id = 0, None, None
        self._file = tempfile.NamedTemporaryFile("wb", dir=self.out.parent, prefix=f".{self.out.name}.", delete=False)

    def write(self, chunk: np.ndarray | Sequence[int]) -> None:
        a = np.asarray(chunk)
        if not len(a):
            return
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.tokenizer.vocab_size:
            raise ValueError(
                f"token id {hi if hi >= self.tokenizer.vocab_size else lo} for {self.out} is outside the "
                f"vocabulary of {self.tokenizer.name!r} ({self.tokenizer.vocab_size} ids)"
            )
        self.min_id = lo if self.min_id is None else min(self.min_id, lo)
        self.max_id = hi if self.max_id is None else max(self.max_id, hi)
        self._file.write(np.ascontiguousarray(a, dtype=self.dtype.newbyteorder("<")).tobytes())
        self.n_tokens += len(a)

    def commit(self, **extra) -> int:
        """Rename the .bin and its sidecar (with ``extra`` fields) into place; returns the token count."""
        if self.n_tokens == 0:
            self.abort()
            raise ValueError(f"nothing to write to {self.out}: the inputs hold no text")
        tmp_json = None
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            meta = {
                "format": SIDECAR_FORMAT,
                "version": SIDECAR_VERSION,
                "dtype": self.dtype.name,
                "n_tokens": self.n_tokens,
                **tokenizer_identity(self.tokenizer),
                "min_id": self.min_id,
                "max_id": self.max_id,
                **extra,
            }
            tmp_json = _write_json_atomic(sidecar_path(self.out), meta)
            mode = 0o666 & ~_umask()  # mkstemp's files are private (0600); give the outputs ordinary permissions
            os.chmod(self._file.name, mode)
            os.chmod(tmp_json, mode)
            os.replace(self._file.name, self.out)
            os.replace(tmp_json, sidecar_path(self.out))
            tmp_json = None
        finally:
            if tmp_json is not None:
                Path(tmp_json).unlink(missing_ok=True)
            Path(self._file.name).unlink(missing_ok=True)
        return self.n_tokens

    def abort(self) -> None:
        self._file.close()
        Path(self._file.name).unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_token_file(chunks: Iterable[np.ndarray], out_path: str | os.PathLike, tokenizer) -> int:
    """Write a token stream to `out_path` (.bin) and its JSON sidecar, atomically; returns the token count."""
    with TokenWriter(out_path, tokenizer) as w:
        for chunk in chunks:
            w.write(chunk)
        return w.commit()


# ---------------------------------------------------------------------------------------------
# Indexing


@dataclass(frozen=True)
class ShardInfo:
    """An indexed .bin: what reading it needs."""

    path: str
    n_tokens: int
    dtype: str  # numpy dtype name (little-endian on disk)
    min_id: int
    max_id: int


def read_sidecar(path: str | os.PathLike) -> dict:
    """The sidecar of a .bin, or a ValueError saying why it cannot be used."""
    side = sidecar_path(path)
    if not side.is_file():
        raise ValueError(f"{path} has no sidecar {side}")
    try:
        meta = json.loads(side.read_text())
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        np.dtype(meta["dtype"]), int(meta["n_tokens"]), str(meta["tokenizer"])
        int(meta["vocab_size"]), int(meta["eos_id"])
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"sidecar {side} is unreadable ({e!r})") from None
    return meta


def _pread_tokens(fd: int, dtype: np.dtype, start: int, count: int, path) -> np.ndarray:
    nbytes = count * dtype.itemsize
    buf = os.pread(fd, nbytes, start * dtype.itemsize)
    if len(buf) != nbytes:
        raise ValueError(f"{path} is shorter than its sidecar says (truncated after it was indexed)")
    return np.frombuffer(buf, dtype.newbyteorder("<"))


def _sample_range(path: Path, dtype: np.dtype, n_tokens: int) -> tuple[int, int]:
    """(min, max) id over SAMPLE_BLOCKS blocks spread evenly over the file, the first and last included."""
    block = min(SAMPLE_BLOCK_TOKENS, n_tokens)
    starts = np.unique(np.linspace(0, n_tokens - block, SAMPLE_BLOCKS).astype(np.int64))
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [_pread_tokens(fd, dtype, int(s), block, path) for s in starts]
    finally:
        os.close(fd)
    return min(int(p.min()) for p in parts), max(int(p.max()) for p in parts)


def _scan_range(path: Path, dtype: np.dtype, n_tokens: int) -> tuple[int, int]:
    """(min, max) id of the whole file, read in bounded chunks."""
    lo, hi = None, None
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, n_tokens, _SCAN_TOKENS):
            part = _pread_tokens(fd, dtype, start, min(_SCAN_TOKENS, n_tokens - start), path)
            lo = int(part.min()) if lo is None else min(lo, int(part.min()))
            hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    finally:
        os.close(fd)
    return lo, hi


def index_token_file(path: str | os.PathLike, tokenizer) -> ShardInfo:
    """Check a .bin against its sidecar and `tokenizer` (cheaply: see the module doc) and return its index entry."""
    path = Path(path)
    fix = f"re-run scripts/preprocess_data.py --tokenizer {tokenizer.name} --output {path}"
    try:
        meta = read_sidecar(path)
    except ValueError as e:
        raise ValueError(f"{e}; {fix}") from None
    dtype, n_tokens = np.dtype(meta["dtype"]), int(meta["n_tokens"])
    made_with, ours = {k: meta.get(k) for k in tokenizer_identity(tokenizer)}, tokenizer_identity(tokenizer)
    if made_with != ours:
        raise ValueError(
            f"{path} was tokenized with {meta['tokenizer']!r} (vocab {meta['vocab_size']}, eos {meta['eos_id']}"
            + (f", tokenizer.json sha256 {meta['tokenizer_sha256']}" if meta.get("tokenizer_sha256") else "")
            + f") but this run uses {tokenizer.name!r} (vocab {tokenizer.vocab_size}, eos {tokenizer.eos_id}"
            + (f", tokenizer.json sha256 {ours['tokenizer_sha256']}" if ours.get("tokenizer_sha256") else "")
            + f"); use that tokenizer or {fix}"
        )
    size = path.stat().st_size
    if dtype != token_dtype(tokenizer.vocab_size) or size != n_tokens * dtype.itemsize:
        raise ValueError(
            f"{path} holds {size} bytes, not the {n_tokens} {dtype} tokens its sidecar "
            f"promises (truncated or overwritten); {fix}"
        )
    if n_tokens == 0:
        return ShardInfo(str(path), 0, dtype.name, 0, 0)
    claimed = (meta.get("min_id"), meta.get("max_id"))
    if claimed == (None, None):  # a version-1 sidecar: no claim to verify, so read the file once
        lo, hi = _scan_range(path, dtype, n_tokens)
    else:
        try:
            lo, hi = int(claimed[0]), int(claimed[1])
        except (TypeError, ValueError):
            raise ValueError(f"sidecar {sidecar_path(path)} has unreadable min_id / max_id {claimed}; {fix}") from None
        s_lo, s_hi = _sample_range(path, dtype, n_tokens)
        if s_lo < lo or s_hi > hi:
            raise ValueError(
                f"{path} holds ids {s_lo}..{s_hi} in a sample but its sidecar says {lo}..{hi}: the sidecar does not "
                f"describe this file (overwritten or hand-made); {fix}"
            )
    if lo < 0 or hi >= tokenizer.vocab_size:
        raise ValueError(
            f"{path} holds token id {hi} but the vocabulary of {tokenizer.name!r} has {tokenizer.vocab_size} ids "
            f"(0..{tokenizer.vocab_size - 1}): it was made with another tokenizer whatever its sidecar says; {fix}"
        )
    return ShardInfo(str(path), n_tokens, dtype.name, lo, hi)


def open_token_file(path: str | os.PathLike, tokenizer) -> np.ndarray:
    """Memory-map a .bin written by `write_token_file`, checking it was made with `tokenizer`."""
    info = index_token_file(path, tokenizer)
    dtype = np.dtype(info.dtype)
    if info.n_tokens == 0:
        return np.empty(0, dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(info.n_tokens,))


# ---------------------------------------------------------------------------------------------
# A token stream of many pieces


class TokenShards:
    """A flat, read-only token stream made of pieces laid end to end: `ShardInfo` shards (read on demand with
    ``os.pread``, at most 64 files open) and in-memory arrays. ``ts[a:b]`` is a view (no copy); ``read`` and
    ``gather`` return arrays. Every id returned is checked against ``vocab_size`` (a shard that lies about its
    contents is named, never fed to the embedding). Pickles by reference: shards travel as paths."""

    ndim = 1

    def __init__(self, pieces: Sequence[ShardInfo | np.ndarray], vocab_size: int, dtype: np.dtype | None = None):
        self.pieces = [p for p in pieces if (p.n_tokens if isinstance(p, ShardInfo) else len(p))]
        self.vocab_size = int(vocab_size)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(vocab_size)
        for p in self.pieces:
            kind = np.dtype(p.dtype)
            if kind != self.dtype:
                where = p.path if isinstance(p, ShardInfo) else "an in-memory piece"
                raise ValueError(f"{where} holds {kind} tokens, not {self.dtype}")
        lengths = [p.n_tokens if isinstance(p, ShardInfo) else len(p) for p in self.pieces]
        self._ends = np.cumsum(np.array([0] + lengths, dtype=np.int64))
        self.start, self.stop = 0, int(self._ends[-1])
        self._fds: OrderedDict[int, int] = OrderedDict()

    # -- a view
    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise TypeError("index a TokenShards with a slice (ts[a:b]); read(a, b) returns tokens")
        a, b, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenShards slices must be contiguous")
        view = object.__new__(TokenShards)
        view.__dict__.update(self.__dict__)
        view.start, view.stop = self.start + a, self.start + max(a, b)
        view._fds = OrderedDict()
        return view

    @property
    def n_shards(self) -> int:
        return sum(isinstance(p, ShardInfo) for p in self.pieces)

    # -- reading
    def _fd(self, i: int) -> int:
        fd = self._fds.pop(i, None)
        if fd is None:
            if len(self._fds) >= _OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1])
            fd = os.open(self.pieces[i].path, os.O_RDONLY)
        self._fds[i] = fd
        return fd

    def _piece(self, i: int, a: int, b: int) -> np.ndarray:
        p = self.pieces[i]
        if isinstance(p, ShardInfo):
            return _pread_tokens(self._fd(i), self.dtype, a, b - a, p.path)
        return p[a:b]

    def _read_into(self, out: np.ndarray, pos: int) -> None:
        """Fill ``out`` with the tokens at absolute positions [pos, pos + len(out))."""
        i = int(np.searchsorted(self._ends, pos, side="right")) - 1
        filled = 0
        while filled < len(out):
            lo = pos + filled - int(self._ends[i])
            n = min(len(out) - filled, int(self._ends[i + 1]) - int(self._ends[i]) - lo)
            out[filled : filled + n] = self._piece(i, lo, lo + n)
            filled += n
            i += 1

    def _checked(self, out: np.ndarray, where: np.ndarray) -> np.ndarray:
        if out.size and int(out.max()) >= self.vocab_size:
            flat = int(np.argmax(out.reshape(-1) >= self.vocab_size))
            row, col = divmod(flat, out.shape[-1]) if out.ndim == 2 else (0, flat)
            pos = int(where[row]) + col
            i = int(np.searchsorted(self._ends, pos, side="right")) - 1
            p = self.pieces[i]
            name = p.path if isinstance(p, ShardInfo) else "tokenized text"
            raise ValueError(
                f"{name} holds token id {int(out.reshape(-1)[flat])} at token {pos - int(self._ends[i])}, outside "
                f"the vocabulary of {self.vocab_size} ids: the file changed since it was indexed or its sidecar "
                f"lies; re-run scripts/preprocess_data.py"
            )
        return out

    def read(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """Tokens [a, b) of this view as an array."""
        b = len(self) if b is None else b
        if not 0 <= a <= b <= len(self):
            raise IndexError(f"read [{a}, {b}) outside [0, {len(self)})")
        out = np.empty(b - a, self.dtype)
        if b > a:
            self._read_into(out, self.start + a)
        return self._checked(out, np.array([self.start + a]))

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``[s, s + length)`` for every s of ``starts`` (positions in this view), as [len(starts), length]."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"rows of {length} tokens at {starts.min()}..{starts.max()} leave [0, {len(self)})")
        out = np.empty((len(starts), length), self.dtype)
        where = starts + self.start
        for r, s in enumerate(where):
            self._read_into(out[r], int(s))
        return self._checked(out, where)

    def to_numpy(self) -> np.ndarray:
        return self.read()

    def __repr__(self) -> str:
        return (
            f"TokenShards({len(self):,} tokens of {self.dtype}, {self.n_shards} shard(s), "
            f"{len(self.pieces) - self.n_shards} in-memory piece(s))"
        )

    # -- pickling (DataLoader workers): shards by path, no file descriptors
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fds"] = OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def gather_rows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """Rows of ``length`` tokens at ``starts`` from an array or a `TokenShards` (the one reader of windows)."""
    if isinstance(tokens, TokenShards):
        return tokens.gather(starts, length)
    return tokens[np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)]
