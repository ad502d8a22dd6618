"""Tokenizers described by a dataset's meta.json: char-level, byte-level, and tiktoken BPE."""

from __future__ import annotations

from typing import Protocol


class TokenizerError(ValueError):
    """Text that a tokenizer cannot encode, or a meta.json it cannot read."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One token per distinct character of the corpus, in sorted order (nanoGPT's shakespeare_char)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self._index})
        if missing:
            raise TokenizerError(f"characters not in this char-level vocabulary: {''.join(missing)!r}")
        return [self._index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if 0 <= i < self.vocab_size else "\ufffd" for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as tokens: a fixed 256-entry vocabulary that encodes any text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    def __init__(self, encoding: str):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("the tiktoken package is needed for this dataset: pip install tiktoken") from None
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as e:  # noqa: BLE001 - network and cache errors vary
            raise TokenizerError(f"cannot load the tiktoken encoding '{encoding}' (offline and not cached?): "
                                 f"{str(e).splitlines()[0]}") from None
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if 0 <= i < self.vocab_size])


def from_meta(meta: dict) -> Tokenizer:
    spec = meta.get("tokenizer", {})
    kind = spec.get("kind")
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return TiktokenTokenizer(spec["encoding"])
    raise TokenizerError(f"meta.json names an unknown tokenizer kind {kind!r} (known: char, byte, tiktoken)")
