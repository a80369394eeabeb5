"""Datasets (pysource, text, memmap, synthetic) and the DataLoader that feeds the trainer.

Every dataset yields the same thing: item ``i`` is ``(x, y)``, two int64 tensors of
``seq_len`` tokens cut from the non-overlapping window of ``seq_len + 1`` tokens that
starts at token ``i * seq_len``; ``y`` is ``x`` shifted by one. ``len = (n_tokens - 1) //
seq_len``. The four sources differ in where the tokens come from and *when* they are read:

* ``pysource`` -- this interpreter's standard library, byte-level, tokenised once into a
  nanoGPT-style uint16 cache and memory-mapped afterwards (reading is nearly free).
* ``text`` -- the user's file or folder, byte-level, read with seek + read inside
  ``__getitem__``, i.e. in the DataLoader workers, so ``dataloader.num_workers`` matters.
* ``memmap`` -- pre-tokenised uint16 ``.bin`` files (nanoGPT's raw format or llm.c's
  format with its 256 x int32 header).
* ``synthetic`` -- random tokens from (seed, split, index): pure throughput, no I/O.

Datasets hold paths and numbers only, so they pickle cheaply for ``spawn`` workers; a
memmap is opened lazily in whichever process first reads from it.

A user's mistake raises :class:`perfrun.config.ConfigError` with one line: what, why, fix.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import signal
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, SequentialSampler

from perfrun.atomic import atomic_write
from perfrun.config import ConfigError

__all__ = [
    "DataBundle",
    "build_datasets",
    "build_loader",
    "ResumableSampler",
    "MemmapTokens",
    "TextBytes",
    "SyntheticTokens",
]

BYTE_VOCAB = 256
DEFAULT_VOCAB = 50257  # GPT-2's tokenizer
SYNTHETIC_WINDOWS = 1 << 20  # virtual length of each synthetic split
VOCAB_CHECK_TOKENS = 1 << 24  # max-token check reads at most this prefix of each file (32 MiB)

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

PYSOURCE_FORMAT = 1  # bump when the way pysource is tokenised changes: old caches are ignored


@dataclass
class DataBundle:
    """What the trainer needs from the data: two datasets, the vocabulary and one log line."""

    train: Dataset
    val: Dataset
    vocab_size: int  # the real vocabulary; the model pads it to a multiple of 64
    description: str


# --------------------------------------------------------------------------- datasets


class _Windows(Dataset):
    """Window arithmetic shared by every source; subclasses say how to read a window."""

    def __init__(self, n_tokens: int, seq_len: int) -> None:
        self.n_tokens = int(n_tokens)
        self.seq_len = int(seq_len)

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def _window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``index`` as a numpy integer array."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        w = torch.from_numpy(np.asarray(self._window(index), dtype=np.int64))
        return w[:-1], w[1:]


class MemmapTokens(_Windows):
    """uint16 tokens in a file (after ``header_bytes``), tokens [start, start + n_tokens).

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
    ) -> None:
        super().__init__(n_tokens, seq_len)
        self.path = str(path)
        self.header_bytes = int(header_bytes)
        self.file_tokens = int(file_tokens)
        self.start = int(start)
        self._mm: np.memmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mm"] = None
        return state

    def _tokens(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(
                self.path, dtype=np.uint16, mode="r",
                offset=self.header_bytes, shape=(self.file_tokens,),
            )
        return self._mm

    def _window(self, index: int) -> np.ndarray:
        lo = self.start + index * self.seq_len
        return np.asarray(self._tokens()[lo : lo + self.seq_len + 1])


class TextBytes(_Windows):
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
        self.files = [str(f) for f in files]
        self.sizes = [int(s) for s in sizes]
        self.offsets = [0]  # offsets[k]: stream position of files[k]'s first byte
        for s in self.sizes:
            self.offsets.append(self.offsets[-1] + s)
        self.start = int(start)

    def _window(self, index: int) -> np.ndarray:
        lo = self.start + index * self.seq_len
        hi = lo + self.seq_len + 1
        k = bisect.bisect_right(self.offsets, lo) - 1
        parts: list[bytes] = []
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
            parts.append(got)
            pos += want
            k += 1
        return np.frombuffer(b"".join(parts), dtype=np.uint8)


class SyntheticTokens(_Windows):
    """Random tokens in [0, vocab_size), a pure function of (seed, stream, index).

    Any process, any worker count and any order of access gives the same window for an
    index, so runs are reproducible and the loader does no I/O.
    """

    def __init__(
        self, *, vocab_size: int, seq_len: int, seed: int, stream: int, windows: int
    ) -> None:
        super().__init__(windows * seq_len + 1, seq_len)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF  # SeedSequence wants non-negative
        self.stream = int(stream)

    def _window(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, index])
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)


# --------------------------------------------------------------------------- helpers


def _count(n: int) -> str:
    """Short human count for the log line: 950, 12.3K, 28.1M, 1.2B."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _check_splits(where: str, n_train: int, n_val: int, seq_len: int, val_note: str) -> None:
    """Each split must hold at least one window of seq_len + 1 tokens."""
    need = seq_len + 1
    for split, n in (("train", n_train), ("val", n_val)):
        if n >= need:
            continue
        fixes = [f"a smaller data.seq_len (at most {n - 1})"] if n >= 2 else []
        fixes.append("more data")
        if split == "val" and val_note:
            fixes.append("a larger data.val_fraction")
        fix = ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
        raise ConfigError(
            f"{where}: the {split} split{val_note if split == 'val' else ''} has {n} tokens but "
            f"one sequence of data.seq_len={seq_len} needs {need}; use {fix}"
        )


def _resolve(path: Any, name: str) -> Path:
    if not path:
        raise ConfigError(f"data={name} needs a file or folder; add data.path=/path/to/your/data")
    p = Path(str(path)).expanduser()
    if not p.exists():
        where = "" if p.is_absolute() else f" (relative to {os.getcwd()})"
        raise ConfigError(
            f"data.path={path} does not exist{where}; check the spelling or give an absolute path"
        )
    return p


def _split_stream(n: int, val_fraction: float) -> tuple[int, int]:
    """Train = the first part, val = the last ``val_fraction`` of a token stream."""
    n_val = int(round(n * val_fraction))
    return n - n_val, n_val


# --------------------------------------------------------------------------- text


def _list_files(root: Path) -> list[Path]:
    """Regular, non-hidden files below ``root`` (hidden folders skipped too), sorted."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            p = Path(dirpath, fn)
            if not fn.startswith(".") and p.is_file():
                out.append(p)
    return sorted(out, key=lambda q: q.relative_to(root).as_posix())


def _text_bundle(cfg: Any, seq_len: int) -> DataBundle:
    path = cfg.path
    p = _resolve(path, "text")
    if p.is_dir():
        files = _list_files(p)
        if not files:
            raise ConfigError(
                f"data.path={path} is a folder with no files (hidden files are skipped); "
                "put text files in it or point data.path at a file"
            )
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"data.path={path} is neither a regular file nor a folder; point it at text")
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) == 0:
        what = "is empty (0 bytes)" if p.is_file() else f"holds only empty files ({len(files)})"
        raise ConfigError(f"data.path={path} {what}; point data.path at text with content")
    kept = [(f, s) for f, s in zip(files, sizes, strict=True) if s > 0]
    for f, _ in kept:
        try:
            with open(f, "rb"):
                pass
        except OSError as e:
            raise ConfigError(
                f"data.path={path}: cannot read {f} ({e.strerror}); fix its permissions or remove it"
            ) from None
    total = sum(s for _, s in kept)
    n_train, n_val = _split_stream(total, float(cfg.val_fraction))
    _check_splits(
        f"data.path={path}", n_train, n_val, seq_len,
        f" (the last data.val_fraction={cfg.val_fraction} of the bytes)",
    )
    names = [str(f) for f, _ in kept]
    szs = [s for _, s in kept]
    train = TextBytes(names, szs, start=0, n_tokens=n_train, seq_len=seq_len)
    val = TextBytes(names, szs, start=n_train, n_tokens=n_val, seq_len=seq_len)
    desc = (
        f"text: {_count(n_train)} train bytes, {_count(n_val)} val bytes from {len(kept)} "
        f"file{'s' if len(kept) != 1 else ''} under {p} (read in the DataLoader)"
    )
    return DataBundle(train, val, BYTE_VOCAB, desc)


# --------------------------------------------------------------------------- memmap


@dataclass
class _BinInfo:
    path: Path
    header_bytes: int
    n_tokens: int
    fmt: str  # "nanoGPT" | "llm.c"


def _inspect_bin(path: Path, shown: str) -> _BinInfo:
    """Tell nanoGPT's raw uint16 from llm.c's headed format and check the size adds up.

    llm.c is detected by its magic 20240520 in the first int32. Other llm.c magics, and any
    1024-byte block that looks like a header (a yyyymmdd-like first int32 and ints 3..255
    all zero: 506 zero tokens in a row would be absurd as real data), are refused rather than
    misread as tokens.
    """
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{shown} is empty (0 bytes); write tokens into it or point data.path elsewhere")
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
        if len(head) < LLMC_HEADER_BYTES:
            raise ConfigError(
                f"{shown} starts with llm.c's magic {LLMC_MAGIC} but is only {size} bytes, shorter "
                f"than its {LLMC_HEADER_BYTES}-byte header; the file is truncated, re-create it"
            )
        header = np.frombuffer(head, dtype="<i4")
        version, count = int(header[1]), int(header[2])
        if version != LLMC_VERSION:
            raise ConfigError(
                f"{shown} has llm.c's header with version {version}; perfrun reads version "
                f"{LLMC_VERSION} (GPT-2, uint16 tokens); re-export with write_datafile(..., 'gpt-2')"
            )
        payload = size - LLMC_HEADER_BYTES
        if count <= 0:
            raise ConfigError(f"{shown} has an llm.c header that says it holds {count} tokens; re-create it")
        if payload != 2 * count:
            raise ConfigError(
                f"{shown}: its llm.c header says {count} tokens but the file holds {payload / 2:g} "
                f"({size} bytes); the file is truncated or damaged, re-download or re-export it"
            )
        return _BinInfo(path, LLMC_HEADER_BYTES, count, "llm.c")
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
    return _BinInfo(path, 0, size // 2, "nanoGPT")


def _check_vocab(info: _BinInfo, shown: str, vocab_size: int) -> None:
    """Reject ids the embedding cannot hold, reading a bounded prefix so it stays fast."""
    n = min(info.n_tokens, VOCAB_CHECK_TOKENS)
    mm = np.memmap(info.path, dtype=np.uint16, mode="r", offset=info.header_bytes, shape=(n,))
    top = int(mm.max())
    del mm
    if top >= vocab_size:
        raise ConfigError(
            f"{shown} holds token id {top} but data.vocab_size={vocab_size}; set "
            f"data.vocab_size={top + 1} or more (GPT-2's tokenizer is 50257)"
        )


def _memmap_bundle(cfg: Any, seq_len: int) -> DataBundle:
    path = cfg.path
    p = _resolve(path, "memmap")
    vocab = int(cfg.vocab_size) if cfg.vocab_size is not None else DEFAULT_VOCAB
    if p.is_dir():
        train_path, val_path = p / "train.bin", p / "val.bin"
        if not train_path.is_file():
            bins = sorted(q.name for q in p.glob("*.bin"))
            found = f" (it holds {', '.join(bins[:5])}{'...' if len(bins) > 5 else ''})" if bins else ""
            raise ConfigError(
                f"data.path={path} is a folder without train.bin{found}; put the training tokens "
                f"in {p / 'train.bin'} or point data.path at a .bin file"
            )
        if not val_path.is_file():
            val_path = None
    elif p.is_file():
        if p.suffix != ".bin":
            raise ConfigError(
                f"data.path={path} is not a .bin file; data=memmap reads pre-tokenised uint16 "
                "tokens (nanoGPT or llm.c); for raw text use data=text"
            )
        train_path, val_path = p, None
    else:
        raise ConfigError(f"data.path={path} is neither a regular file nor a folder")

    def shown(q: Path) -> str:
        return f"data.path={path}" if q == p else f"data.path={path}: {q.name}"

    tr = _inspect_bin(train_path, shown(train_path))
    _check_vocab(tr, shown(train_path), vocab)
    if val_path is not None:
        va = _inspect_bin(val_path, shown(val_path))
        _check_vocab(va, shown(val_path), vocab)
        _check_splits(f"data.path={path}", tr.n_tokens, va.n_tokens, seq_len, "")
        train = MemmapTokens(tr.path, header_bytes=tr.header_bytes, file_tokens=tr.n_tokens,
                             start=0, n_tokens=tr.n_tokens, seq_len=seq_len)
        val = MemmapTokens(va.path, header_bytes=va.header_bytes, file_tokens=va.n_tokens,
                           start=0, n_tokens=va.n_tokens, seq_len=seq_len)
        n_train, n_val, source = tr.n_tokens, va.n_tokens, "train.bin + val.bin"
    else:
        n_train, n_val = _split_stream(tr.n_tokens, float(cfg.val_fraction))
        _check_splits(
            f"data.path={path}", n_train, n_val, seq_len,
            f" (the last data.val_fraction={cfg.val_fraction} of the tokens)",
        )
        common = dict(header_bytes=tr.header_bytes, file_tokens=tr.n_tokens, seq_len=seq_len)
        train = MemmapTokens(tr.path, start=0, n_tokens=n_train, **common)
        val = MemmapTokens(tr.path, start=n_train, n_tokens=n_val, **common)
        source = f"{tr.path.name}, last {cfg.val_fraction} as val"
    desc = (
        f"memmap ({tr.fmt}): {_count(n_train)} train tokens, {_count(n_val)} val tokens, "
        f"vocab {vocab} ({p}: {source})"
    )
    return DataBundle(train, val, vocab, desc)


# --------------------------------------------------------------------------- synthetic


def _synthetic_bundle(cfg: Any, seq_len: int, seed: int) -> DataBundle:
    vocab = int(cfg.vocab_size) if cfg.vocab_size is not None else DEFAULT_VOCAB
    if vocab < 2:
        raise ConfigError(f"data.vocab_size={vocab} must be >= 2; set data.vocab_size=50257")
    train = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed, stream=0,
                            windows=SYNTHETIC_WINDOWS)
    val = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed, stream=1,
                          windows=SYNTHETIC_WINDOWS)
    desc = (f"synthetic: random tokens, vocab {vocab}, {SYNTHETIC_WINDOWS} windows of "
            f"{seq_len} per split (seed {seed}, no I/O)")
    return DataBundle(train, val, vocab, desc)


# --------------------------------------------------------------------------- pysource


def _stdlib_dir() -> Path:
    """The running interpreter's standard library (a function so tests can point it elsewhere)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _cache_root(cfg: Any) -> Path:
    root = getattr(cfg, "cache_dir", None) or os.environ.get("PERFRUN_CACHE") or "~/.cache/perfrun"
    return Path(str(root)).expanduser()


def _pysource_files(stdlib: Path) -> list[tuple[str, int]]:
    """(relative posix path, size) of every ``*.py`` under stdlib, sorted; installed
    packages (``site-packages``, ``dist-packages``) are not the standard library."""
    out: list[tuple[str, int]] = []
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                try:
                    st = os.stat(full)
                except OSError:  # a dangling link: not source we can read
                    continue
                out.append((Path(full).relative_to(stdlib).as_posix(), st.st_size))
    out.sort()
    return out


def _is_val(rel: str, val_fraction: float) -> bool:
    """A file's split, from a stable hash of its relative path: same on every machine/run."""
    h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "little")
    return h / 2.0**64 < val_fraction


def _read_meta(folder: Path) -> dict[str, Any] | None:
    """The cache's meta.json if the cache is complete and its files have the recorded sizes."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        ok = (
            meta.get("format") == PYSOURCE_FORMAT
            and (folder / "train.bin").stat().st_size == 2 * int(meta["train_tokens"])
            and (folder / "val.bin").stat().st_size == 2 * int(meta["val_tokens"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if ok else None


def _tokenise(stdlib: Path, rels: list[str]) -> np.ndarray:
    """Concatenated bytes of the files as uint16 tokens (byte-level, no separator)."""
    buf = bytearray()
    for rel in rels:
        buf += (stdlib / rel).read_bytes()
    return np.frombuffer(bytes(buf), dtype=np.uint8).astype(np.uint16)


def _build_pysource_cache(folder: Path, stdlib: Path, files: list[tuple[str, int]],
                          val_fraction: float, key_info: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    # litter from a run killed mid-write (SIGKILL skips cleanup): remove if older than 1 h
    for stale in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                stale.unlink()
    train_rels = [r for r, _ in files if not _is_val(r, val_fraction)]
    val_rels = [r for r, _ in files if _is_val(r, val_fraction)]
    train = _tokenise(stdlib, train_rels)
    val = _tokenise(stdlib, val_rels)
    # meta.json goes last: its presence (with matching sizes) is what marks a complete cache
    atomic_write(folder / "train.bin", memoryview(train))
    atomic_write(folder / "val.bin", memoryview(val))
    meta = dict(key_info, format=PYSOURCE_FORMAT, train_files=len(train_rels),
                val_files=len(val_rels), train_tokens=int(train.size), val_tokens=int(val.size))
    meta["build_s"] = round(time.perf_counter() - t0, 3)
    atomic_write(folder / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def _pysource_bundle(cfg: Any, seq_len: int) -> DataBundle:
    stdlib = _stdlib_dir()
    files = _pysource_files(stdlib)
    if not files:
        raise ConfigError(
            f"data=pysource found no *.py files under {stdlib} (a stripped Python install?); "
            "use data=synthetic or data=text data.path=..."
        )
    val_fraction = float(cfg.val_fraction)
    key_info = {"python": sys.version, "stdlib": str(stdlib), "val_fraction": val_fraction}
    h = hashlib.sha256(json.dumps(key_info, sort_keys=True).encode())
    h.update(str(PYSOURCE_FORMAT).encode())
    for rel, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    v = sys.version_info
    folder = _cache_root(cfg) / f"pysource-py{v.major}.{v.minor}.{v.micro}-{h.hexdigest()[:16]}"
    meta = _read_meta(folder)
    if meta is not None:
        how = "reused"
    else:
        try:
            meta = _build_pysource_cache(folder, stdlib, files, val_fraction, key_info)
        except OSError as e:
            raise ConfigError(
                f"cannot write the pysource cache at {folder} ({e.strerror or e}); set "
                "data.cache_dir=/a/writable/folder (or $PERFRUN_CACHE)"
            ) from None
        how = f"built in {meta['build_s']:.1f} s"
    n_train, n_val = int(meta["train_tokens"]), int(meta["val_tokens"])
    _check_splits(f"data=pysource ({stdlib})", n_train, n_val, seq_len, "")
    train = MemmapTokens(folder / "train.bin", header_bytes=0, file_tokens=n_train,
                         start=0, n_tokens=n_train, seq_len=seq_len)
    val = MemmapTokens(folder / "val.bin", header_bytes=0, file_tokens=n_val,
                       start=0, n_tokens=n_val, seq_len=seq_len)
    desc = (
        f"pysource: {_count(n_train)} train tokens, {_count(n_val)} val tokens from "
        f"{meta['train_files']}+{meta['val_files']} stdlib files (cache {folder}, {how})"
    )
    return DataBundle(train, val, BYTE_VOCAB, desc)


# --------------------------------------------------------------------------- public API


def build_datasets(data_cfg: Any, seq_len: int, seed: int) -> DataBundle:
    """Train and val datasets for ``data_cfg.name``; bad input raises a one-line ConfigError."""
    seq_len = int(seq_len)
    if seq_len < 1:
        raise ConfigError(f"data.seq_len={seq_len} must be >= 1; set data.seq_len=null for the model's block_size")
    name = str(data_cfg.name)
    if name == "pysource":
        return _pysource_bundle(data_cfg, seq_len)
    if name == "text":
        return _text_bundle(data_cfg, seq_len)
    if name == "memmap":
        return _memmap_bundle(data_cfg, seq_len)
    if name == "synthetic":
        return _synthetic_bundle(data_cfg, seq_len, int(seed))
    raise ConfigError(f"data.name={name} is not an option; choose one of pysource, text, memmap, synthetic")


class ResumableSampler(Sampler[int]):
    """A seeded shuffle that can start anywhere: epoch ``e`` is the permutation drawn from
    ``seed + e`` alone, and iteration starts at ``start`` within it.

    This is what makes resume exact: the trainer records (epoch, samples consumed) and a
    resumed run rebuilds the same order from there, without replaying earlier epochs.

    Under DDP each of ``world`` ranks takes every ``world``-th index from ``start`` on
    (``start`` counts samples of all ranks), so batch k of the ranks together is batch k of
    one process with a batch ``world`` times as large: the global order does not depend on
    the number of ranks. The tail is cut to a multiple of ``world`` so that every rank has
    as many batches as the others (a rank that ran out first would wait forever).
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.rank, self.world = rank, world
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g)[self.start:]
        order = order[: len(order) - len(order) % self.world][self.rank::self.world]
        return iter(order.tolist())

    def __len__(self) -> int:
        return (self.n - self.start) // self.world


def _worker_init(worker_id: int) -> None:
    """Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the trainer (not
    its workers) decides how to stop; a worker killed by it would break the last step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_loader(
    dataset: Dataset, dl_cfg: Any, *, device_type: str, shuffle: bool, seed: int, rank: int = 0, world: int = 1
) -> DataLoader:
    """A DataLoader whose order depends on ``seed`` only (not on batch size or workers).

    ``shuffle=True`` draws one seeded permutation per epoch (:class:`ResumableSampler`) and ``drop_last`` cuts it into
    batches, so batch 8 is exactly four consecutive batches of 2. The loader also gets its
    own generator for the workers' base seed, so creating an iterator (e.g. for each eval)
    never draws from torch's global RNG and cannot perturb training randomness.

    ``rank``/``world`` shard the order (see :class:`ResumableSampler`), the validation
    order too, so that the ranks' mean val loss is the one-process figure.

    A training loader (``shuffle=True``) with fewer sequences than one batch is a
    ConfigError: it would yield nothing, forever. A validation loader is allowed to be
    empty; the trainer warns that there is no val loss and trains on.
    """
    batch_size = int(dl_cfg.batch_size)
    n = len(dataset)  # type: ignore[arg-type]
    if shuffle and n < batch_size * world:
        raise ConfigError(
            f"dataloader.batch_size={batch_size}" + (f" x {world} ranks" if world > 1 else "")
            + f" is larger than the {n} training sequences, "
            f"so the loader would yield no batch; set dataloader.batch_size<={max(n // world, 1)}, "
            "use more data or a smaller data.seq_len"
        )
    workers = int(dl_cfg.num_workers)
    sampler: Any = (
        ResumableSampler(n, int(seed), rank, world) if shuffle else SequentialSampler(dataset)
    )
    if not shuffle and world > 1:  # batch k of all ranks = batch k of one process, as for training
        sampler = list(range(n - n % world))[rank::world]
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs["persistent_workers"] = bool(dl_cfg.persistent_workers)
        if getattr(dl_cfg, "prefetch_factor", None) is not None:
            kwargs["prefetch_factor"] = int(dl_cfg.prefetch_factor)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=bool(dl_cfg.pin_memory) and device_type == "cuda",
        drop_last=True,
        generator=torch.Generator().manual_seed(int(seed) + 1),
        worker_init_fn=_worker_init if workers > 0 else None,
        **kwargs,
    )
