"""What every source shares: the window arithmetic, the bundle handed to the trainer, and
the checks and log figures that each source reports the same way."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from perfrun.config import ConfigError
from perfrun.data.tokenizers import Tokenizer, load_tokenizer

DEFAULT_VOCAB = 50257  # GPT-2's tokenizer


@dataclass
class DataBundle:
    """What the trainer needs from the data: two datasets, the vocabulary and one log line."""

    train: Dataset
    val: Dataset
    vocab_size: int  # the real vocabulary; the model pads it to a multiple of 64
    description: str
    # the tokenizer that turns text into these ids (a load_tokenizer spec), recorded with the
    # run so that text can be generated from it; None where nobody knows (raw .bin, synthetic)
    tokenizer: str | None = None


class Windows(Dataset):
    """Item ``i`` is ``(x, y)``: the window of ``seq_len + 1`` tokens that starts at token
    ``i * seq_len``, as two int64 tensors, ``y`` shifted by one. Subclasses say how to read
    a window; ``len = (n_tokens - 1) // seq_len``."""

    def __init__(self, n_tokens: int, seq_len: int) -> None:
        self.n_tokens = int(n_tokens)
        self.seq_len = int(seq_len)

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``index`` as a numpy integer array."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        w = torch.from_numpy(np.asarray(self.window(index), dtype=np.int64))
        return w[:-1], w[1:]


def count(n: int | float) -> str:
    """Short human count for the log line: 950, 12.3K, 28.1M, 1.2B."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def check_splits(where: str, n_train: int, n_val: int, seq_len: int, val_note: str) -> None:
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


def resolve_path(path: Any, name: str) -> Path:
    """``data.path`` as an existing path, or a one-line ConfigError."""
    if not path:
        raise ConfigError(f"data={name} needs a file or folder; add data.path=/path/to/your/data")
    p = Path(str(path)).expanduser()
    if not p.exists():
        where = "" if p.is_absolute() else f" (relative to {os.getcwd()})"
        raise ConfigError(
            f"data.path={path} does not exist{where}; check the spelling or give an absolute path"
        )
    return p


def data_tokenizer(spec: str) -> Tokenizer:
    """``data.tokenizer``, loaded; its one-line error names the key as the user wrote it."""
    try:
        return load_tokenizer(spec)
    except ConfigError as e:
        raise ConfigError(f"data.{e}" if str(e).startswith("tokenizer=") else str(e)) from None


def split_stream(n: int, val_fraction: float) -> tuple[int, int]:
    """Train = the first part, val = the last ``val_fraction`` of a token stream."""
    n_val = int(round(n * val_fraction))
    return n - n_val, n_val
