"""``data=custom data.target=...``: the user's map-style Dataset of (input, target) tensors.

It is built once with ``data.args`` and split in two: its last ``data.val_fraction`` of
items are the validation set. Both go through the same resumable sampler, workers and device
input as perfrun's own datasets. The vocabulary (for a GPT or Llama on these ids) is
``data.vocab_size`` or the dataset's ``vocab_size`` attribute.
"""

from __future__ import annotations

import operator
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
    """Its ``__len__``, which must be a whole number >= 1 (torch's ``len`` raises on a negative one)."""
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise ConfigError(f"data.target={target} built a {type(dataset).__name__}, not a map-style Dataset; "
                          "give a class with __len__ and __getitem__ (a torch.utils.data.Dataset)")
    if not hasattr(type(dataset), "__len__"):
        raise ConfigError(f"data.target={target} has no __len__ (an iterable dataset?); perfrun's resumable "
                          "sampler needs a map-style Dataset with __len__ and __getitem__")
    raw = type(dataset).__len__(dataset)  # type: ignore[attr-defined]  # what len() refuses, said as returned
    try:
        n = operator.index(raw)  # a numpy integer is a length too, as for len()
    except TypeError:
        n = 0
    if n < 1:
        raise ConfigError(f"data.target={target}: its __len__ returned {raw!r}, so there is nothing to train on; "
                          "it must return the number of items (>= 2: one at least for training, one for validation)")
    return n


def _check_item(dataset: Dataset, target: str, seq_len: int) -> None:
    """Item 0 is two tensors whose input is ``seq_len`` long (tokens per step and FLOPs count on it)."""
    item = _pair(dataset, 0, target)
    length = item[0].shape[-1] if item[0].dim() else 1
    if length != seq_len:
        raise ConfigError(f"data.target={target}: its inputs are {length} long but the run's sequence length is "
                          f"{seq_len}; set data.seq_len={length} (or model.block_size={length})")


def _pair(dataset: Dataset, i: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    item = dataset[i]
    if not (isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(t, torch.Tensor) for t in item)):
        raise ConfigError(f"data.target={target}: item {i} is {type(item).__name__}, not (input, target) tensors; "
                          "make __getitem__ return a pair of tensors")
    return item[0], item[1]


def check_token_ids(data: DataBundle, target: str) -> None:
    """For perfrun's own models (GPT, Llama), which embed token ids: the inputs and targets of
    the first and last item of each split must be integer tensors of ids in [0, vocabulary).
    Sampled, not scanned: a user's dataset may be large and slow to read, and an item's ids
    are usually made the same way for every item."""
    vocab = data.vocab_size
    if vocab < 2:
        return  # no vocabulary given: building the model says so
    for split, dataset in (("train", data.train), ("validation", data.val)):
        n = len(dataset)  # type: ignore[arg-type]
        for i in sorted({0, n - 1}):
            for part, t in zip(("input", "target"), _pair(dataset, i, target), strict=True):
                where = f"data.target={target}: {split} item {i}'s {part}"
                if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                    raise ConfigError(f"{where} is a {t.dtype} tensor, not token ids; perfrun's GPT and Llama embed "
                                      "integer ids: return torch.long tensors (or train your own model, model=custom)")
                low, high = int(t.min()), int(t.max())
                if low < 0 or high >= vocab:
                    bad = low if low < 0 else high
                    raise ConfigError(f"{where} holds token id {bad} but the vocabulary is {vocab} (ids 0 to {vocab - 1}, "
                                      "from data.vocab_size or the dataset's vocab_size); set data.vocab_size above "
                                      "the largest id, or fix the dataset")
