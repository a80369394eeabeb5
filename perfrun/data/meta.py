"""The meta file of a token folder written by ``perfrun prepare``: which tokenizer made the
ids, the vocabulary, the element type and how many tokens each split holds.

``data=memmap`` reads it, so training picks the vocabulary and records the tokenizer by
itself, reads uint32 files as uint32, and refuses a folder whose files do not have the
sizes it records (a damaged copy, or files from two different runs of prepare).
A ``meta.json`` written by something else (no ``"format": "perfrun-tokens"``) is not ours
and is left alone: the folder is then read as nanoGPT's raw uint16 files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from perfrun.checkpoint.atomic import atomic_write
from perfrun.config import ConfigError

META_NAME = "meta.json"
META_FORMAT = "perfrun-tokens"
DTYPES = ("uint16", "uint32")


@dataclass
class TokenMeta:
    tokenizer: str  # a load_tokenizer spec; a file name is relative to the folder
    vocab_size: int
    eot_id: int | None  # the end-of-text id between documents (None: the tokenizer has none)
    dtype: str  # uint16 when every id fits, else uint32
    train_tokens: int
    val_tokens: int
    documents: int
    source: str  # the corpus it was prepared from
    val_fraction: float
    split: str = "documents"  # documents: every (1/val_fraction)-th document; stream: the last tokens
    format: str = META_FORMAT
    version: int = 1

    def tokenizer_spec(self, folder: Path) -> str:
        """The tokenizer as load_tokenizer takes it from anywhere (a file made absolute)."""
        if self.tokenizer == "byte" or self.tokenizer.startswith("tiktoken:"):
            return self.tokenizer
        return str((folder / self.tokenizer).resolve())

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits in it (nanoGPT's format), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(folder: Path) -> TokenMeta | None:
    """The folder's perfrun meta file, None when there is none (or it is not perfrun's)."""
    path = folder / META_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); run perfrun prepare again") from None
    if not isinstance(raw, dict) or raw.get("format") != META_FORMAT:
        return None
    try:
        meta = TokenMeta(**{f.name: raw[f.name] for f in fields(TokenMeta) if f.name in raw})
        ok = meta.dtype in DTYPES and int(meta.vocab_size) >= 2 and min(meta.train_tokens, meta.val_tokens) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{path} is perfrun's meta file but its fields are damaged; run perfrun prepare again")
    return meta


def write_meta(folder: Path, meta: TokenMeta) -> Path:
    return atomic_write(folder / META_NAME, json.dumps(asdict(meta), indent=1) + "\n")


def check_sizes(folder: Path, meta: TokenMeta, shown: str) -> None:
    """train.bin and val.bin must hold exactly the tokens the meta file records."""
    for split, n in (("train", meta.train_tokens), ("val", meta.val_tokens)):
        path = folder / f"{split}.bin"
        size = path.stat().st_size if path.is_file() else None
        if size != n * meta.itemsize:
            got = "is missing" if size is None else f"has {size} bytes"
            raise ConfigError(
                f"{shown}: {split}.bin {got} but {META_NAME} records {n} {meta.dtype} tokens "
                f"({n * meta.itemsize} bytes); the folder is damaged or mixed, run perfrun prepare again"
            )
