"""``data=text``: the user's file or folder, read inside the DataLoader workers (so
``dataloader.num_workers`` matters).

With ``data.tokenizer=byte`` (the default) a token is a byte and a window is read with one
seek + read. With another tokenizer (a tokenizer.json or tiktoken:gpt2), each window's text
is read and tokenised in the worker: the bytes per token are measured once on the first
256 KiB of the corpus, window ``i`` starts at the first whitespace at or after byte
``i * seq_len * bytes_per_token`` of its split, and as much text is read as it takes to
give ``seq_len + 1`` tokens (wrapping round to the split's start at its end). Files are
documents: each is tokenised on its own and followed by the end-of-text token.
"""

from __future__ import annotations

import bisect
import codecs
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from perfrun.config import ConfigError, DataConfig
from perfrun.data.files import corpus_files
from perfrun.data.tokenizers import BYTE_VOCAB, Tokenizer, load_tokenizer
from perfrun.data.windows import (
    DataBundle,
    Windows,
    check_splits,
    count,
    data_tokenizer,
    resolve_path,
    split_stream,
)

SAMPLE_BYTES = 256 * 1024  # text tokenised at setup to measure bytes per token
SNAP_BYTES = 256  # how far a window's start may move to reach whitespace
WHITESPACE = tuple(bytes([c]) for c in b" \t\n\r\f\v")
UTF8_CONTINUATION = bytes(range(0x80, 0xC0))


class TextStream:
    """A list of files seen as one stream of bytes; ``read(lo, hi)`` gives the pieces of
    stream bytes [lo, hi), one per file, each with whether it ends its file."""

    def __init__(self, files: Sequence[str | os.PathLike[str]], sizes: Sequence[int]) -> None:
        self.files = [str(f) for f in files]
        self.sizes = [int(s) for s in sizes]
        self.offsets = [0]  # offsets[k]: stream position of files[k]'s first byte
        for s in self.sizes:
            self.offsets.append(self.offsets[-1] + s)

    def read(self, lo: int, hi: int) -> list[tuple[bytes, bool]]:
        k = bisect.bisect_right(self.offsets, lo) - 1
        parts: list[tuple[bytes, bool]] = []
        pos = lo
        while pos < hi:
            file_lo = pos - self.offsets[k]
            want = min(hi, self.offsets[k + 1]) - pos
            with open(self.files[k], "rb") as f:
                f.seek(file_lo)
                got = f.read(want)
            if len(got) != want:
                raise ConfigError(
                    f"data.path: {self.files[k]} shrank while training (wanted {want} bytes at "
                    f"{file_lo}, got {len(got)}); keep the data unchanged during a run"
                )
            parts.append((got, pos + want == self.offsets[k + 1]))
            pos += want
            k += 1
        return parts


class TextBytes(Windows):
    """Bytes of a list of files seen as one stream, read with seek + read per item.

    Windows span file boundaries (files are concatenated with no separator), so no byte is
    wasted and a folder of small files behaves like one big file. Reading happens here, in
    ``__getitem__``, so it runs inside the DataLoader workers.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        sizes: Sequence[int],
        *,
        start: int,
        n_tokens: int,
        seq_len: int,
    ) -> None:
        super().__init__(n_tokens, seq_len)
        self.stream = TextStream(files, sizes)
        self.start = int(start)

    def window(self, index: int) -> np.ndarray:
        lo = self.start + index * self.seq_len
        parts = self.stream.read(lo, lo + self.seq_len + 1)
        return np.frombuffer(b"".join(p for p, _ in parts), dtype=np.uint8)


class TextTokens(Windows):
    """Windows of ``seq_len + 1`` tokens of the split [start, start + n_bytes) of a text
    stream, tokenised in ``__getitem__`` (the DataLoader's workers) by the tokenizer named
    by ``tokenizer``, loaded once per process and never pickled."""

    def __init__(self, stream: TextStream, *, start: int, n_bytes: int, bytes_per_token: float,
                 seq_len: int, tokenizer: str) -> None:
        super().__init__(int(n_bytes / bytes_per_token), seq_len)
        self.stream = stream
        self.start, self.n_bytes = int(start), int(n_bytes)
        self.bytes_per_token = float(bytes_per_token)
        self.tokenizer = tokenizer
        self._tok: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tok"] = None
        return state

    def _read(self, pos: int, budget: int) -> list[tuple[bytes, bool]]:
        """``budget`` bytes from split offset ``pos`` on, wrapping round at the split's end
        (which then ends a document, as a file's end does)."""
        parts: list[tuple[bytes, bool]] = []
        while budget > 0:
            take = min(budget, self.n_bytes - pos)
            got = self.stream.read(self.start + pos, self.start + pos + take)
            if pos + take == self.n_bytes:
                got[-1] = (got[-1][0], True)
            parts += got
            budget -= take
            pos = (pos + take) % self.n_bytes
        return parts

    def _encode(self, parts: list[tuple[bytes, bool]], snap: bool) -> list[int]:
        """Token ids of the pieces. With ``snap`` the first starts at whitespace (within
        SNAP_BYTES, else at a character's start), and the last, unless it ends a document,
        is cut back to whitespace, so that no word is split; a document's end adds the
        end-of-text token."""
        tok = self._tok = self._tok or load_tokenizer(self.tokenizer)
        if snap:
            first, ends = parts[0]
            space = re.search(rb"\s", first[:SNAP_BYTES])
            parts[0] = (first[space.start():] if space else first.lstrip(UTF8_CONTINUATION), ends)
        last, ends = parts[-1]
        if not ends:
            space = max(last.rfind(c) for c in WHITESPACE)
            parts[-1] = (last[:space] if space > 0 else last, False)
        ids: list[int] = []
        for data, ends in parts:
            ids += tok.encode(codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=ends))
            if ends and tok.eot_id is not None:
                ids.append(tok.eot_id)
        return ids

    def window(self, index: int) -> np.ndarray:
        pos = int(index * self.seq_len * self.bytes_per_token)
        snap = self.start + pos not in self.stream.offsets  # a document's start needs no snapping
        budget = int((self.seq_len + 1) * self.bytes_per_token * 1.25) + 64
        while True:
            ids = self._encode(self._read(pos, budget), snap)
            if len(ids) > self.seq_len:
                return np.asarray(ids[: self.seq_len + 1], dtype=np.int64)
            budget *= 2


def _bytes_per_token(stream: TextStream, n_bytes: int, tok: Tokenizer) -> float:
    """Measured on the corpus's first bytes (at most SAMPLE_BYTES), the same every run."""
    sample = b"".join(p for p, _ in stream.read(0, min(n_bytes, SAMPLE_BYTES)))
    text = sample.decode("utf-8", errors="replace")
    return max(len(sample) / max(len(tok.encode(text)), 1), 1e-3)


def text_bundle(cfg: DataConfig, seq_len: int) -> DataBundle:
    path = cfg.path
    p = resolve_path(path, "text")
    kept = corpus_files(p, f"data.path={path}")
    names, sizes = [str(f) for f, _ in kept], [s for _, s in kept]
    total = sum(sizes)
    n_train, n_val = split_stream(total, float(cfg.val_fraction))
    val_note = f" (the last data.val_fraction={cfg.val_fraction} of the bytes)"
    files = f"{len(kept)} file{'s' if len(kept) != 1 else ''} under {p}"
    spec = str(getattr(cfg, "tokenizer", None) or "byte")
    if spec == "byte":
        check_splits(f"data.path={path}", n_train, n_val, seq_len, val_note)
        train = TextBytes(names, sizes, start=0, n_tokens=n_train, seq_len=seq_len)
        val = TextBytes(names, sizes, start=n_train, n_tokens=n_val, seq_len=seq_len)
        desc = f"text: {count(n_train)} train bytes, {count(n_val)} val bytes from {files} (read in the DataLoader)"
        return DataBundle(train, val, BYTE_VOCAB, desc, tokenizer="byte")
    tok = data_tokenizer(spec)
    stream = TextStream(names, sizes)
    bpt = _bytes_per_token(stream, total, tok)
    train = TextTokens(stream, start=0, n_bytes=n_train, bytes_per_token=bpt, seq_len=seq_len, tokenizer=tok.name)
    val = TextTokens(stream, start=n_train, n_bytes=n_val, bytes_per_token=bpt, seq_len=seq_len, tokenizer=tok.name)
    check_splits(f"data.path={path}", train.n_tokens, val.n_tokens, seq_len, val_note)
    desc = (f"text: ~{count(train.n_tokens)} train tokens, ~{count(val.n_tokens)} val tokens ({bpt:.2f} bytes/token) "
            f"from {files}, tokenizer {tok.name}, vocab {tok.vocab_size} (tokenised in the DataLoader)")
    return DataBundle(train, val, tok.vocab_size, desc, tokenizer=tok.name)
