"""``data=pysource``: this interpreter's standard library, byte-level, tokenised once into a
nanoGPT-style uint16 cache and memory-mapped afterwards (reading is nearly free)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from perfrun.checkpoint.atomic import atomic_write
from perfrun.config import ConfigError, DataConfig
from perfrun.data.cache import cache_root, remove_stale_temps
from perfrun.data.memmap import MemmapTokens
from perfrun.data.tokenizers import BYTE_VOCAB
from perfrun.data.windows import DataBundle, check_splits, count

PYSOURCE_FORMAT = 1  # bump when the way pysource is tokenised changes: old caches are ignored


def stdlib_dir() -> Path:
    """The running interpreter's standard library (a function so tests can point it elsewhere)."""
    return Path(sysconfig.get_paths()["stdlib"])


def pysource_files(stdlib: Path) -> list[tuple[str, int]]:
    """(relative posix path, size) of every ``*.py`` under stdlib, sorted; installed
    packages (``site-packages``, ``dist-packages``) are not the standard library.

    The running interpreter's own library is listed once per process: it does not change
    while the interpreter runs, and listing its ~1,800 files in every job of a sweep is a
    visible share of a tiny CPU job. Any other folder is listed at each call."""
    if stdlib == Path(sysconfig.get_paths()["stdlib"]):
        return list(_own_stdlib_files(stdlib))
    return _listed(stdlib)


@functools.cache
def _own_stdlib_files(stdlib: Path) -> tuple[tuple[str, int], ...]:
    return tuple(_listed(stdlib))


def _listed(stdlib: Path) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    skip = {"site-packages", "dist-packages", "__pycache__"}
    top = os.fspath(stdlib)
    for dirpath, dirnames, filenames in os.walk(top):  # strings, not Paths: every run lists ~1,800 files
        dirnames[:] = [d for d in dirnames if d not in skip]
        folder = os.path.relpath(dirpath, top).replace(os.sep, "/")
        for fn in filenames:
            if fn.endswith(".py"):
                try:
                    size = os.stat(os.path.join(dirpath, fn)).st_size
                except OSError:  # a dangling link: not source we can read
                    continue
                out.append((fn if folder == "." else f"{folder}/{fn}", size))
    out.sort()
    return out


def is_val(rel: str, val_fraction: float) -> bool:
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


def _build_cache(folder: Path, stdlib: Path, files: list[tuple[str, int]],
                 val_fraction: float, key_info: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    train_rels = [r for r, _ in files if not is_val(r, val_fraction)]
    val_rels = [r for r, _ in files if is_val(r, val_fraction)]
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


def pysource_bundle(cfg: DataConfig, seq_len: int) -> DataBundle:
    tokenizer = getattr(cfg, "tokenizer", None) or "byte"
    if tokenizer != "byte":
        raise ConfigError(
            f"data=pysource is byte-level, so data.tokenizer={tokenizer} does not apply; use data=text "
            f"data.path=... data.tokenizer={tokenizer}, or perfrun prepare and data=memmap"
        )
    stdlib = stdlib_dir()
    files = pysource_files(stdlib)
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
    folder = cache_root(cfg) / f"pysource-py{v.major}.{v.minor}.{v.micro}-{h.hexdigest()[:16]}"
    meta = _read_meta(folder)
    if meta is not None:
        how = "reused"
    else:
        try:
            meta = _build_cache(folder, stdlib, files, val_fraction, key_info)
        except OSError as e:
            raise ConfigError(
                f"cannot write the pysource cache at {folder} ({e.strerror or e}); set "
                "data.cache_dir=/a/writable/folder (or $PERFRUN_CACHE)"
            ) from None
        how = f"built in {meta['build_s']:.1f} s"
    n_train, n_val = int(meta["train_tokens"]), int(meta["val_tokens"])
    check_splits(f"data=pysource ({stdlib})", n_train, n_val, seq_len, "")
    train = MemmapTokens(folder / "train.bin", header_bytes=0, file_tokens=n_train,
                         start=0, n_tokens=n_train, seq_len=seq_len)
    val = MemmapTokens(folder / "val.bin", header_bytes=0, file_tokens=n_val,
                       start=0, n_tokens=n_val, seq_len=seq_len)
    desc = (
        f"pysource: {count(n_train)} train tokens, {count(n_val)} val tokens from "
        f"{meta['train_files']}+{meta['val_files']} stdlib files (cache {folder}, {how})"
    )
    return DataBundle(train, val, BYTE_VOCAB, desc, tokenizer="byte")
