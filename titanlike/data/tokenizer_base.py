"""What every tokenizer shares (tiktoken's and Hugging Face's): BOS / EOS around a document's ids."""

from __future__ import annotations


class SpecialTokens:
    """``name``, ``eos_id`` and ``bos_id`` (None when the tokenizer has none); `wrap` puts them around ids."""

    name: str
    eos_id: int
    bos_id: int | None

    def wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            if self.bos_id is None:
                raise ValueError(f"tokenizer {self.name!r} has no bos token; encode with bos=False")
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids
