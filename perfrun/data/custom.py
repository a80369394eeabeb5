"""``data=custom data.target=...``: the user's map-style Dataset of (input, target) tensors.

It is built once with ``data.args`` and split in two: its last ``data.val_fraction`` of
items are the validation set. Both go through the same resumable sampler, workers and device
input as perfrun's own datasets. The vocabulary (for a GPT or Llama on these ids) is
``data.vocab_size`` or the dataset's ``vocab_size`` attribute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, Subset

from perfrun.config import ConfigError
from perfrun.data.windows import DataBundle
from perfrun.user_code import instantiate

if TYPE_CHECKING:
    from perfrun.config import DataConfig


def custom_bundle(cfg: DataConfig, seq_len: int) -> DataBundle:
    """The user's dataset, checked (map-style, items of two tensors) and split train/val."""
    if not cfg.target:
        raise ConfigError("data=custom needs data.target, your Dataset class (pkg.module.ClassName or "
                          "path/to/file.py:ClassName), e.g. data.target=examples/seq_classifier.py:Sequences")
    dataset = instantiate(cfg.target, cfg.args, "data.target")
    n = _length(dataset, cfg.target)
    _check_item(dataset, cfg.target, seq_len)
    n_val = max(1, round(n * float(cfg.val_fraction)))
    if n - n_val < 1:
        raise ConfigError(f"data.target={cfg.target} has {n} items, too few to keep {n_val} for validation; "
                          "give it more items or a smaller data.val_fraction")
    vocab = cfg.vocab_size if cfg.vocab_size is not None else getattr(dataset, "vocab_size", None)
    train, val = Subset(dataset, range(n - n_val)), Subset(dataset, range(n - n_val, n))
    desc = f"custom: {cfg.target}, {n - n_val:,} training and {n_val:,} validation items"
    return DataBundle(train, val, int(vocab or 0), desc)


def _length(dataset: object, target: str) -> int:
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise ConfigError(f"data.target={target} built a {type(dataset).__name__}, not a map-style Dataset; "
                          "give a class with __len__ and __getitem__ (a torch.utils.data.Dataset)")
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"data.target={target} has no __len__ (an iterable dataset?); perfrun's resumable "
                          "sampler needs a map-style Dataset with __len__ and __getitem__") from None


def _check_item(dataset: Dataset, target: str, seq_len: int) -> None:
    """Item 0 is two tensors whose input is ``seq_len`` long (tokens per step and FLOPs count on it)."""
    item = dataset[0]
    if not (isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(t, torch.Tensor) for t in item)):
        raise ConfigError(f"data.target={target}: item 0 is {type(item).__name__}, not (input, target) tensors; "
                          "make __getitem__ return a pair of tensors")
    length = item[0].shape[-1] if item[0].dim() else 1
    if length != seq_len:
        raise ConfigError(f"data.target={target}: its inputs are {length} long but the run's sequence length is "
                          f"{seq_len}; set data.seq_len={length} (or model.block_size={length})")
