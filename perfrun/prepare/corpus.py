"""What ``perfrun prepare`` reads: the corpus cut into tasks, and the tokenising of a task
(run in the worker processes).

Documents: a text file is one document, a ``.jsonl`` line one document (its ``text_field``).
A piece is a byte range of one file, at most PIECE_BYTES long: a whole small file, a part
of a large one (cut after a newline between two non-spaces, where GPT-2's pre-tokenizer
splits anyway, so the ids are those of the whole file), or a run of whole .jsonl lines.
A task, what one worker does in one round trip, is a run of consecutive pieces of about
PIECE_BYTES. The cuts depend on the corpus alone, never on the number of workers, so any
``workers`` gives the same files byte for byte.

The val split is by document: document ``k`` (in path order, then line order) goes to val
when ``floor((k + 1) * f) > floor(k * f)``, i.e. every (1/f)-th document, spread evenly.
A corpus of fewer than 1/f documents (one big file, say) is split as a stream instead,
as nanoGPT does for Shakespeare: the last ``f`` of its tokens are val.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from perfrun.config import ConfigError
from perfrun.data.tokenizers import Tokenizer, load_tokenizer

PIECE_BYTES = 1 << 20  # the most one task reads
LOOK_BACK = 1 << 16  # how far back from PIECE_BYTES a piece's cut is looked for
CLEAN_CUT = re.compile(rb"\S\n(?=\S)")  # a cut after this newline leaves GPT-2's pre-tokens whole


@dataclass(frozen=True)
class Piece:
    path: str
    lo: int  # byte range [lo, hi) of the file
    hi: int
    jsonl: bool
    doc: int  # index of the first document (a text file's, or the range's first line's)
    line: int  # 1-based line number of the range's first line (for error messages)
    ends_doc: bool  # a text file's last piece (a .jsonl range ends its documents itself)


Task = tuple[Piece, ...]  # consecutive pieces, one round trip to a worker


@dataclass
class Encoded:
    train: np.ndarray
    val: np.ndarray
    bytes: int
    documents: int
    not_utf8: int  # pieces with bytes that are not UTF-8 (replaced by U+FFFD)


@dataclass
class Settings:
    """What every worker needs to encode a task, sent once to each."""

    tokenizer: str
    dtype: str
    val_fraction: float
    by_document: bool  # False: everything to train; the stream is split at the end
    text_field: str


def is_val(doc: int, val_fraction: float) -> bool:
    return math.floor((doc + 1) * val_fraction) > math.floor(doc * val_fraction)


def _cut(f: BinaryIO, lo: int, limit: int) -> int:
    """The end of the piece that starts at ``lo``: just after the last newline before
    ``limit`` that has a non-space on each side (there GPT-2's pre-tokenizer splits the
    whole text the same way), else after the last newline, else the last space, else at
    ``limit`` moved back to a UTF-8 character's start."""
    start = max(lo, limit - LOOK_BACK)
    f.seek(start)
    window = f.read(limit - start + 1)  # one byte more: what follows the cut
    clean = [m.end() for m in CLEAN_CUT.finditer(window)]
    if clean:
        return start + clean[-1]
    body = window[:-1]
    for sep in (b"\n", b" "):
        i = body.rfind(sep)
        if i > 0:
            return start + i + 1
    end = limit
    while end > lo + 1 and 0x80 <= window[end - start] < 0xC0:
        end -= 1
    return end


def _text_pieces(path: Path, size: int, doc: int) -> list[Piece]:
    pieces, lo = [], 0
    with open(path, "rb") as f:
        while lo < size:
            hi = size if size - lo <= PIECE_BYTES else _cut(f, lo, lo + PIECE_BYTES)
            pieces.append(Piece(str(path), lo, hi, False, doc, 1, hi == size))
            lo = hi
    return pieces


def _jsonl_pieces(path: Path, size: int, doc: int) -> tuple[list[Piece], int]:
    """Runs of whole lines of at most PIECE_BYTES (a longer line is a run of its own)."""
    pieces, lo, line = [], 0, 1
    with open(path, "rb") as f:
        while lo < size:
            f.seek(lo)
            block = f.read(PIECE_BYTES)
            end = block.rfind(b"\n") + 1 if lo + len(block) < size else len(block)
            while end == 0:  # a line longer than PIECE_BYTES: read on to its end
                more = f.read(PIECE_BYTES)
                nl = more.find(b"\n")
                block += more[: nl + 1] if nl >= 0 else more
                if nl >= 0 or not more:
                    end = len(block)
            lines = block[:end].count(b"\n") + (0 if block[:end].endswith(b"\n") else 1)
            pieces.append(Piece(str(path), lo, lo + end, True, doc, line, True))
            lo, doc, line = lo + end, doc + lines, line + lines
    return pieces, doc


def plan(files: list[tuple[Path, int]]) -> tuple[list[Task], int]:
    """The tasks for the corpus's files (in order: pieces of consecutive small files are
    grouped up to PIECE_BYTES, so that a worker's round trip is worth its while) and the
    corpus's number of documents."""
    pieces: list[Piece] = []
    doc = 0
    for path, size in files:
        if path.suffix == ".jsonl":
            more, doc = _jsonl_pieces(path, size, doc)
            pieces += more
        else:
            pieces += _text_pieces(path, size, doc)
            doc += 1
    tasks: list[Task] = []
    group: list[Piece] = []
    for piece in pieces:
        if group and sum(p.hi - p.lo for p in group) + piece.hi - piece.lo > PIECE_BYTES:
            tasks.append(tuple(group))
            group = []
        group.append(piece)
    return tasks + ([tuple(group)] if group else []), doc


_settings: Settings | None = None
_tokenizer: Tokenizer | None = None


def start_worker(settings: Settings) -> None:
    """A worker's initializer (and the single-process path's): load the tokenizer once."""
    global _settings, _tokenizer
    _settings, _tokenizer = settings, load_tokenizer(settings.tokenizer)


def _ids(text: str | bytes) -> list[int] | np.ndarray:
    assert _tokenizer is not None
    if _tokenizer.name == "byte":  # bytes as they are: what data=text reads
        return np.frombuffer(text if isinstance(text, bytes) else text.encode("utf-8"), dtype=np.uint8)
    assert isinstance(text, str)
    return _tokenizer.encode(text)


def _json_documents(piece: Piece, raw: bytes) -> list[tuple[int, str | bytes, bool]]:
    """(document index, text, True) for each non-blank line of a .jsonl range."""
    assert _settings is not None
    key = _settings.text_field
    lines = raw.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    out: list[tuple[int, str | bytes, bool]] = []
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[key]
            if not isinstance(text, str):
                raise TypeError(f"its {key!r} is a {type(text).__name__}")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            reason = f"no {key!r} key" if isinstance(e, KeyError) else str(e).splitlines()[0][:80]
            raise ConfigError(f"path: line {piece.line + k} of {piece.path} is not a JSON object with a {key!r} "
                              f"string ({reason}); fix the line, or name the key with text_field=") from None
        out.append((piece.doc + k, text, True))
    return out


def _read(piece: Piece) -> tuple[list[tuple[int, str | bytes, bool]], bool]:
    """The piece's documents as (index, text, ends the document), and whether some of its
    bytes were not UTF-8. The byte tokenizer takes the bytes as they are, undecoded."""
    assert _tokenizer is not None
    with open(piece.path, "rb") as f:
        f.seek(piece.lo)
        raw = f.read(piece.hi - piece.lo)
    if piece.jsonl:
        return _json_documents(piece, raw), False
    if _tokenizer.name == "byte":
        return [(piece.doc, raw, piece.ends_doc)], False
    try:
        return [(piece.doc, raw.decode("utf-8"), piece.ends_doc)], False
    except UnicodeDecodeError:
        return [(piece.doc, raw.decode("utf-8", errors="replace"), piece.ends_doc)], True


def encode(task: Task) -> Encoded:
    """Read and tokenise one task; its documents' ids (each document followed by the
    end-of-text id) go to train or val."""
    assert _settings is not None and _tokenizer is not None
    dtype = _settings.dtype
    eot = None if _tokenizer.eot_id is None else np.asarray([_tokenizer.eot_id], dtype=dtype)
    splits: dict[bool, list[np.ndarray]] = {False: [], True: []}
    documents = not_utf8 = 0
    for piece in task:
        docs, bad = _read(piece)
        not_utf8 += bad
        for doc, text, ends in docs:
            ids = np.asarray(_ids(text), dtype=dtype)
            split = _settings.by_document and is_val(doc, _settings.val_fraction)
            splits[split] += [ids] + ([eot] if ends and eot is not None else [])
            documents += ends
    empty = np.empty(0, dtype=dtype)
    return Encoded(np.concatenate(splits[False]) if splits[False] else empty,
                   np.concatenate(splits[True]) if splits[True] else empty,
                   sum(p.hi - p.lo for p in task), documents, not_utf8)
