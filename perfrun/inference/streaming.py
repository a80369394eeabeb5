"""Generated tokens written as text as they come (``perfrun generate stream=true``)."""

from __future__ import annotations

import sys
from typing import Any

from perfrun.data.tokenizers import Tokenizer


class Streamer:
    """Writes tokens as text as they come. Text is printed up to the last complete
    character (a byte-level or BPE token can end inside a multi-byte character; a U+FFFD
    at the end is held back until the next token completes or replaces it)."""

    def __init__(self, tokenizer: Tokenizer, stream: Any = None) -> None:
        self.tokenizer = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.pending: list[int] = []

    def __call__(self, token: int) -> None:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if not text.endswith("\ufffd"):
            self.stream.write(text)
            self.stream.flush()
            self.pending = []

    def close(self) -> None:
        self.stream.write(self.tokenizer.decode(self.pending) + "\n")
        self.stream.flush()
