"""Tokenizers: text to token ids and back, behind one small interface, so training data,
``perfrun prepare`` and ``perfrun generate`` agree on what a token is.

``byte`` is the built-in one (vocabulary 256, every byte its own token).
"""

from __future__ import annotations

from typing import Protocol

BYTE_VOCAB = 256


class Tokenizer(Protocol):
    name: str  # the spec it was loaded from: "byte", "tiktoken:gpt2", or a tokenizer.json path
    vocab_size: int
    eot_id: int | None  # the end-of-text token that separates documents (None: no such token)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces what is not valid UTF-8."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``spec``."""
    if spec == "byte":
        return ByteTokenizer()
    from perfrun.config import ConfigError

    raise ConfigError(f"tokenizer={spec} is not a tokenizer perfrun knows; use tokenizer=byte")
