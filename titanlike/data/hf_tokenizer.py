"""Hugging Face tokenizers: a ``tokenizer.json`` read with the ``tokenizers`` library, offline.

The folders models ship (Llama 3.x, Qwen3, Mistral, DeepSeek, ...) hold ``tokenizer.json`` and
``tokenizer_config.json`` (and often ``config.json``). The token ids are the ``tokenizers`` library's, with what
``transformers`` adds to them: the BOS / EOS tokens named by ``tokenizer_config.json`` (``bos_token``,
``eos_token``, a string or an ``{"content": ...}`` object; a token named there but missing from tokenizer.json is
added as a special token, at the next free id, as ``transformers`` and torchtitan do), else the ids of
``config.json`` (``bos_token_id``, ``eos_token_id``; the first of a list). No special tokens are added by
``encode`` (``add_special_tokens=False``) and special-token strings inside a document are encoded as plain text
(``encode_special_tokens``: ``transformers``' ``split_special_tokens=True``), so data can never inject control
tokens; ``tests/data/test_data_hf_tokenizer.py`` checks the ids against ``transformers`` on a folder written by it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from titanlike.data.tokenizer_base import SpecialTokens

TOKENIZER_FILE = "tokenizer.json"


def hf_tokenizer_file(path: str | Path) -> Path | None:
    """The tokenizer.json that `path` names (the file itself or a folder holding one), else None."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / TOKENIZER_FILE).is_file():
        return p / TOKENIZER_FILE
    if p.is_file() and p.suffix == ".json":
        return p
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _token_content(value, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where} is neither a token string nor an object with 'content': {value!r}")


def _config_id(value, where: str) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} is not a token id: {value!r}")
    return value


class HFTokenizer(SpecialTokens):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json, with the interface of `titanlike.data.Tokenizer`."""

    def __init__(self, path: str | Path):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as RustTokenizer

        file = hf_tokenizer_file(path)
        if file is None:
            raise ValueError(
                f"{path} is not a Hugging Face tokenizer: expected a folder holding {TOKENIZER_FILE} (with "
                f"tokenizer_config.json) or a {TOKENIZER_FILE} file"
            )
        folder = file.parent
        raw = file.read_bytes()
        try:
            tk = RustTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for malformed files
            raise ValueError(f"cannot read {file} with the tokenizers library ({e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        ids: dict[str, tuple[int | None, str]] = {}
        for role in ("bos", "eos"):
            token = _token_content(config.get(f"{role}_token"), f"{folder / 'tokenizer_config.json'} {role}_token")
            if token is not None:
                if tk.token_to_id(token) is None:  # named by the config only: added as transformers adds it
                    tk.add_special_tokens([AddedToken(token, special=True, normalized=False)])
                ids[role] = (tk.token_to_id(token), "tokenizer_config.json")
                continue
            cid = _config_id(model_config.get(f"{role}_token_id"), f"{folder / 'config.json'} {role}_token_id")
            ids[role] = (cid, "config.json") if cid is not None else (None, "")
        if ids["eos"][0] is None:
            raise ValueError(
                f"{folder} names no eos token (tokenizer_config.json has no eos_token, config.json no "
                f"eos_token_id); documents are joined with it: add eos_token to tokenizer_config.json"
            )
        tk.encode_special_tokens = True
        self._tk = tk
        self.path = str(folder)
        self.source = str(folder.resolve())  # what build_tokenizer rebuilds it from
        self.name = folder.resolve().name or "tokenizer"
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        vocab = tk.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        self.eos_id: int = ids["eos"][0]
        self.bos_id: int | None = ids["bos"][0]
        self.sources = {role: where for role, (_, where) in ids.items() if where}
        for role, tid in (("eos", self.eos_id), ("bos", self.bos_id)):
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ValueError(f"{folder}: the {role} id {tid} is outside the vocabulary of {self.vocab_size} ids")
        self.special_tokens: dict[str, int] = dict(
            sorted(
                ((t.content, i) for i, t in tk.get_added_tokens_decoder().items() if t.special), key=lambda kv: kv[1]
            )
        )

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` itself (special-token strings in text encoded as plain text)."""
        return self._tk

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = self._tk.encode(text, add_special_tokens=False).ids
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise self._encode_error(e) from None
        return self.wrap(ids, bos, eos)

    def _encode_error(self, e: Exception) -> ValueError:
        """One line for what the library refuses to encode: a character outside the vocabulary whose unknown token
        (named by tokenizer.json's model) the vocabulary does not hold, named."""
        unk = getattr(self._tk.model, "unk_token", None)
        if unk and self._tk.token_to_id(unk) is None:
            return ValueError(
                f"tokenizer {self.path}: the text holds a character outside its vocabulary, and the unknown token "
                f"{unk!r} that its tokenizer.json names is not in the vocabulary; add {unk!r} to the vocabulary, set "
                f"the model's unk_token to null (such characters are then dropped), or use another tokenizer"
            )
        return ValueError(f"tokenizer {self.path} cannot encode the text ({str(e).splitlines()[0] if str(e) else e!r})")

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int | None = None
    ) -> list[list[int]]:
        """`encode` over many documents in the library's thread pool (sized once per process by the
        RAYON_NUM_THREADS environment variable, all cores by default; ``num_threads`` is tiktoken's knob)."""
        try:
            batch = self._tk.encode_batch_fast(list(texts), add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise self._encode_error(e) from None
        return [self.wrap(e.ids, bos, eos) for e in batch]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self) -> dict:  # the Rust object pickles through its JSON
        state = self.__dict__.copy()
        state["_tk"] = self._tk.to_str()
        return state

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        tk = RustTokenizer.from_str(state["_tk"])
        tk.encode_special_tokens = True
        state["_tk"] = tk
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id}, "
            f"from {self.path})"
        )
