"""``data=memmap``: pre-tokenised ``.bin`` files: nanoGPT's raw uint16, llm.c's format with
its 256 x int32 header, or a folder written by ``perfrun prepare`` (uint16 or uint32, with
a meta file that says which tokenizer made the ids).

Every token id of every file is checked against the vocabulary before training starts,
once per version of a file: the largest id is found by a vectorised pass over the whole
file and recorded in the cache folder, so a 20 GB file is read once, not on every run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perfrun.config import ConfigError, DataConfig
from perfrun.data.cache import cache_root, file_key, read_verdict, write_verdict
from perfrun.data.meta import TokenMeta, check_sizes, read_meta
from perfrun.data.windows import (
    DEFAULT_VOCAB,
    DataBundle,
    Windows,
    check_splits,
    count,
    data_tokenizer,
    resolve_path,
    split_stream,
)

log = logging.getLogger("perfrun")

SCAN_CHUNK = 1 << 24  # tokens per vectorised step of the whole-file id check

# llm.c's token files: a 256 x int32 header, then the tokens. Only GPT-2's uint16 layout is
# read; other llm.c files are recognised by their magic so the error can say what they are.
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_OTHER_MAGICS = {
    20240801: "llama-3 token file (uint32 tokens, version 7)",
    20240522: "eval file (e.g. HellaSwag), not training tokens",
    20240326: "model checkpoint, not token data",
    20240327: "debug state file, not token data",
    20240328: "tokenizer file, not token data",
}


class MemmapTokens(Windows):
    """Tokens of ``dtype`` in a file (after ``header_bytes``), tokens [start, start + n_tokens).

    The memmap is opened on first read and never pickled: each worker maps the file itself.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        header_bytes: int,
        file_tokens: int,
        start: int,
        n_tokens: int,
        seq_len: int,
        dtype: str = "uint16",
    ) -> None:
        super().__init__(n_tokens, seq_len)
        self.path = str(path)
        self.header_bytes = int(header_bytes)
        self.file_tokens = int(file_tokens)
        self.start = int(start)
        self.dtype = dtype
        self._mm: np.memmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mm"] = None
        return state

    def tokens(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(
                self.path, dtype=self.dtype, mode="r",
                offset=self.header_bytes, shape=(self.file_tokens,),
            )
        return self._mm

    def window(self, index: int) -> np.ndarray:
        lo = self.start + index * self.seq_len
        return np.asarray(self.tokens()[lo : lo + self.seq_len + 1])


@dataclass
class BinInfo:
    path: Path
    header_bytes: int
    n_tokens: int
    fmt: str  # "nanoGPT" | "llm.c" | "perfrun prepare"
    dtype: str = "uint16"

    def dataset(self, start: int, n_tokens: int, seq_len: int) -> MemmapTokens:
        return MemmapTokens(self.path, header_bytes=self.header_bytes, file_tokens=self.n_tokens,
                            start=start, n_tokens=n_tokens, seq_len=seq_len, dtype=self.dtype)


def _llmc_info(path: Path, shown: str, head: bytes, size: int) -> BinInfo:
    """A file that starts with llm.c's GPT-2 magic: its header must be whole and agree."""
    if len(head) < LLMC_HEADER_BYTES:
        raise ConfigError(
            f"{shown} starts with llm.c's magic {LLMC_MAGIC} but is only {size} bytes, shorter "
            f"than its {LLMC_HEADER_BYTES}-byte header; the file is truncated, re-create it"
        )
    header = np.frombuffer(head, dtype="<i4")
    version, n = int(header[1]), int(header[2])
    if version != LLMC_VERSION:
        raise ConfigError(
            f"{shown} has llm.c's header with version {version}; perfrun reads version "
            f"{LLMC_VERSION} (GPT-2, uint16 tokens); re-export with write_datafile(..., 'gpt-2')"
        )
    payload = size - LLMC_HEADER_BYTES
    if n <= 0:
        raise ConfigError(f"{shown} has an llm.c header that says it holds {n} tokens; re-create it")
    if payload != 2 * n:
        raise ConfigError(
            f"{shown}: its llm.c header says {n} tokens but the file holds {payload / 2:g} "
            f"({size} bytes); the file is truncated or damaged, re-download or re-export it"
        )
    return BinInfo(path, LLMC_HEADER_BYTES, n, "llm.c")


def inspect_bin(path: Path, shown: str, meta: TokenMeta | None = None) -> BinInfo:
    """Tell nanoGPT's raw uint16 from llm.c's headed format and check the size adds up;
    a file of a ``perfrun prepare`` folder has the element type its meta file records.

    llm.c is detected by its magic 20240520 in the first int32. Other llm.c magics, and any
    1024-byte block that looks like a header (a yyyymmdd-like first int32 and ints 3..255
    all zero: 506 zero tokens in a row would be absurd as real data), are refused rather than
    misread as tokens.
    """
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{shown} is empty (0 bytes); write tokens into it or point data.path elsewhere")
    if meta is not None:
        return BinInfo(path, 0, size // meta.itemsize, "perfrun prepare", meta.dtype)
    try:
        with open(path, "rb") as f:
            head = f.read(LLMC_HEADER_BYTES)
    except OSError as e:
        raise ConfigError(f"{shown} cannot be read ({e.strerror}); fix its permissions") from None
    magic = int.from_bytes(head[:4], "little", signed=True) if len(head) >= 4 else None
    if magic in LLMC_OTHER_MAGICS:
        raise ConfigError(
            f"{shown} is an llm.c {LLMC_OTHER_MAGICS[magic]}, magic {magic}; perfrun reads "
            f"GPT-2 uint16 token files (magic {LLMC_MAGIC}, version {LLMC_VERSION}) or raw uint16"
        )
    if magic == LLMC_MAGIC:
        return _llmc_info(path, shown, head, size)
    if len(head) == LLMC_HEADER_BYTES:
        header = np.frombuffer(head, dtype="<i4")
        if 20000000 <= int(header[0]) <= 21000000 and not header[3:].any():
            raise ConfigError(
                f"{shown} starts like an llm.c header with unknown magic {int(header[0])}; perfrun "
                f"reads llm.c magic {LLMC_MAGIC} version {LLMC_VERSION} or raw uint16 tokens"
            )
    if size % 2:
        raise ConfigError(
            f"{shown} has {size} bytes, an odd number, so it is not uint16 tokens; write it with "
            "np.array(tokens, dtype=np.uint16).tofile(path), or use data=text for raw text"
        )
    return BinInfo(path, 0, size // 2, "nanoGPT")


def largest_token(info: BinInfo, cache: Path) -> tuple[int, int]:
    """(the largest token id in the whole file, the position of its first occurrence).

    A vectorised pass over the file, chunk by chunk; the answer is cached per version of
    the file (path, size, inode, mtime), so the pass happens once.
    """
    key = file_key(info.path, header_bytes=info.header_bytes, dtype=info.dtype)
    known = read_verdict(cache, "largest-token", key)
    if known is not None:
        return int(known["largest"]), int(known["at"])
    t0 = time.perf_counter()
    mm = np.memmap(info.path, dtype=info.dtype, mode="r", offset=info.header_bytes, shape=(info.n_tokens,))
    top, at = -1, 0
    for lo in range(0, info.n_tokens, SCAN_CHUNK):
        chunk = mm[lo : lo + SCAN_CHUNK]
        i = int(chunk.argmax())
        if int(chunk[i]) > top:
            top, at = int(chunk[i]), lo + i
    del mm
    seconds = time.perf_counter() - t0
    try:
        write_verdict(cache, "largest-token", key, {"largest": top, "at": at, "scan_s": round(seconds, 3)})
    except OSError as e:
        log.warning(f"could not record the token check of {info.path} in {cache} ({e.strerror or e}); "
                    "the file will be read whole again on the next run (set data.cache_dir to a writable folder)")
    if seconds > 1:
        log.info(f"checked the {count(info.n_tokens)} token ids of {info.path} in {seconds:.1f} s (once per version of the file)")
    return top, at


def check_vocab(info: BinInfo, shown: str, vocab_size: int, cache: Path) -> None:
    """Reject ids the embedding cannot hold, wherever they are in the file."""
    top, at = largest_token(info, cache)
    if top >= vocab_size:
        raise ConfigError(
            f"{shown} holds token id {top} (first at token {at:,}) but data.vocab_size={vocab_size}; set "
            f"data.vocab_size={top + 1} or more (GPT-2's tokenizer is 50257)"
        )


def _locate(p: Path, path: Any) -> tuple[Path, Path | None]:
    """The train file and the val file (None: split the train file) for ``data.path``."""
    if p.is_dir():
        train_path, val_path = p / "train.bin", p / "val.bin"
        if not train_path.is_file():
            bins = sorted(q.name for q in p.glob("*.bin"))
            found = f" (it holds {', '.join(bins[:5])}{'...' if len(bins) > 5 else ''})" if bins else ""
            raise ConfigError(
                f"data.path={path} is a folder without train.bin{found}; put the training tokens "
                f"in {p / 'train.bin'} or point data.path at a .bin file"
            )
        return train_path, (val_path if val_path.is_file() else None)
    if p.is_file():
        if p.suffix != ".bin":
            raise ConfigError(
                f"data.path={path} is not a .bin file; data=memmap reads pre-tokenised uint16 "
                "tokens (nanoGPT or llm.c); for raw text use data=text"
            )
        return p, None
    raise ConfigError(f"data.path={path} is neither a regular file nor a folder")


def _vocab_and_tokenizer(cfg: DataConfig, meta: TokenMeta | None, folder: Path, shown: str) -> tuple[int, str | None]:
    """The vocabulary and tokenizer of the ids: from the meta file of a prepared folder, else
    from ``data.tokenizer`` when given (loaded, so that a wrong one fails now), else unknown
    (``data.vocab_size``, GPT-2's 50257 by default). ``data.vocab_size`` may raise the
    vocabulary (e.g. to pad it), never lower it under the tokenizer's."""
    given = getattr(cfg, "tokenizer", None)
    if meta is not None:
        spec, origin = meta.tokenizer_spec(folder), f"{folder / 'meta.json'}"
        if given and given not in (spec, meta.tokenizer):
            raise ConfigError(f"data.tokenizer={given} but {origin} says the ids of {shown} were made by "
                              f"{meta.tokenizer}; drop data.tokenizer (it is read from the folder)")
        base = meta.vocab_size
    elif given:
        tok = data_tokenizer(str(given))
        spec, origin, base = tok.name, f"data.tokenizer={given}", tok.vocab_size
    else:
        vocab = int(cfg.vocab_size) if cfg.vocab_size is not None else DEFAULT_VOCAB
        return vocab, None
    if cfg.vocab_size is None:
        return base, spec
    if int(cfg.vocab_size) < base:
        raise ConfigError(f"data.vocab_size={cfg.vocab_size} is smaller than the vocabulary of the tokenizer "
                          f"({base}, {origin}); drop data.vocab_size (the tokenizer's is taken) or raise it")
    return int(cfg.vocab_size), spec


def memmap_bundle(cfg: DataConfig, seq_len: int) -> DataBundle:
    path = cfg.path
    p = resolve_path(path, "memmap")
    train_path, val_path = _locate(p, path)
    folder = train_path.parent
    meta = read_meta(folder) if train_path.name in ("train.bin", "val.bin") else None
    if meta is not None:
        check_sizes(folder, meta, f"data.path={path}")
    vocab, tokenizer = _vocab_and_tokenizer(cfg, meta, folder, f"data.path={path}")
    cache = cache_root(cfg)

    def shown(q: Path) -> str:
        return f"data.path={path}" if q == p else f"data.path={path}: {q.name}"

    tr = inspect_bin(train_path, shown(train_path), meta)
    check_vocab(tr, shown(train_path), vocab, cache)
    if val_path is not None:
        va = inspect_bin(val_path, shown(val_path), meta)
        check_vocab(va, shown(val_path), vocab, cache)
        check_splits(f"data.path={path}", tr.n_tokens, va.n_tokens, seq_len, "")
        train, val = tr.dataset(0, tr.n_tokens, seq_len), va.dataset(0, va.n_tokens, seq_len)
        n_train, n_val, source = tr.n_tokens, va.n_tokens, "train.bin + val.bin"
    else:
        n_train, n_val = split_stream(tr.n_tokens, float(cfg.val_fraction))
        check_splits(
            f"data.path={path}", n_train, n_val, seq_len,
            f" (the last data.val_fraction={cfg.val_fraction} of the tokens)",
        )
        train, val = tr.dataset(0, n_train, seq_len), tr.dataset(n_train, n_val, seq_len)
        source = f"{tr.path.name}, last {cfg.val_fraction} as val"
    desc = (
        f"memmap ({tr.fmt}): {count(n_train)} train tokens, {count(n_val)} val tokens, "
        f"vocab {vocab}{f', tokenizer {tokenizer}' if tokenizer else ''} ({p}: {source})"
    )
    return DataBundle(train, val, vocab, desc, tokenizer=tokenizer)
