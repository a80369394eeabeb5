"""Datasets (pysource, text, memmap, synthetic) and the DataLoader that feeds the trainer.

Every dataset yields the same thing: item ``i`` is ``(x, y)``, two int64 tensors of
``seq_len`` tokens, ``y`` being ``x`` shifted by one (:class:`~perfrun.data.windows.Windows`).
The sources differ in where the tokens come from and *when* they are read, one module each:

* ``pysource`` -- this interpreter's standard library, byte-level, tokenised once into a
  nanoGPT-style uint16 cache (``cache``) and memory-mapped afterwards;
* ``text`` -- the user's file or folder, read (and tokenised, with ``data.tokenizer``)
  inside the DataLoader workers, so ``dataloader.num_workers`` matters;
* ``memmap`` -- pre-tokenised ``.bin`` files: nanoGPT's raw uint16, llm.c's headed format,
  or a folder written by ``perfrun prepare`` (``meta``: tokenizer, vocabulary, uint16/32);
* ``synthetic`` -- random tokens from (seed, split, index): pure throughput, no I/O.

``sources`` picks one by ``data.name``; ``sampler`` holds the resumable, rank-sharded order
and ``loader`` the DataLoader. The names below are imported when first used, so that
``perfrun prepare`` (which needs ``meta`` and ``files``) starts without loading torch.
Datasets hold paths and numbers only, so they pickle cheaply for ``spawn`` workers; a
memmap (or a tokenizer) is opened lazily in whichever process first reads from it.

A user's mistake raises :class:`perfrun.config.ConfigError` with one line: what, why, fix.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from perfrun.data.loader import build_loader
    from perfrun.data.memmap import MemmapTokens
    from perfrun.data.sampler import ResumableSampler
    from perfrun.data.sources import build_datasets
    from perfrun.data.synthetic import SyntheticTokens
    from perfrun.data.text import TextBytes, TextTokens
    from perfrun.data.tokenizers import BYTE_VOCAB
    from perfrun.data.windows import DEFAULT_VOCAB, DataBundle

HOMES = {
    "BYTE_VOCAB": "perfrun.data.tokenizers",
    "DEFAULT_VOCAB": "perfrun.data.windows",
    "DataBundle": "perfrun.data.windows",
    "build_datasets": "perfrun.data.sources",
    "build_loader": "perfrun.data.loader",
    "ResumableSampler": "perfrun.data.sampler",
    "MemmapTokens": "perfrun.data.memmap",
    "TextBytes": "perfrun.data.text",
    "TextTokens": "perfrun.data.text",
    "SyntheticTokens": "perfrun.data.synthetic",
}
__all__ = [
    "BYTE_VOCAB", "DEFAULT_VOCAB", "DataBundle", "build_datasets", "build_loader", "ResumableSampler",
    "MemmapTokens", "TextBytes", "TextTokens", "SyntheticTokens",
]


def __getattr__(name: str) -> Any:
    """``from perfrun.data import build_datasets`` and friends, imported on first use."""
    if name not in HOMES:
        raise AttributeError(f"module 'perfrun.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *HOMES])
