"""A recorded configuration, checked before any of it becomes code: every key the rows of
:mod:`perfrun.ladder.translations` read must hold a value of its schema type or one of its
fixed choices, so that a summary.json changed by hand or by another program cannot put code
into what ``perfrun report --as`` prints."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from perfrun.config import CHOICES, TrainConfig, as_dict
from perfrun.ladder.translations import ROWS
from perfrun.ladder.verdict import flat


@functools.cache
def _defaults() -> dict[str, Any]:
    return flat(as_dict(TrainConfig()))


def default(key: str) -> Any:
    """perfrun's default for ``key`` (None where it has none): what a record lacking it ran with."""
    return _defaults().get(key)


#: keys read beside the rows' own: what setup resolved (fused AdamW, the device, the batch)
DERIVED = {"fused_adamw": (bool,), "device_type": ("cpu", "cuda"), "batch_size": (int,)}
#: keys whose schema default does not tell their type
KINDS: dict[str, tuple[type, ...]] = {"compile_options.dynamic": (bool, type(None)),
                                      "dataloader.prefetch_factor": (int, type(None))}
CHOICE_KEYS = {**CHOICES, "precision.name": ("none", "bf16", "fp16", "fp8"), "distributed": ("none", "ddp", "fsdp")}


def check(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the rows read, each of its schema type (or one of its choices), with perfrun's
    default where a record written by an older perfrun lacks it. Raises ValueError naming the
    first key whose recorded value is not one perfrun writes: no recorded string reaches code
    unless it is one of a key's fixed choices."""
    defaults = _defaults()
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for row in ROWS for k in _keys_read(row.key)):
        value = config.get(key, defaults.get(key))
        if not _fits(key, value, defaults.get(key)):
            raise ValueError(f"{key}={value!r}, not a value perfrun writes there")
        out[key] = value
    for key, kinds in DERIVED.items():
        value = config.get(key)
        if not (value in kinds if isinstance(kinds[0], str) else _is_a(value, kinds)):
            raise ValueError(f"{key}={value!r}, not a value perfrun writes there")
        out[key] = value
    return out


#: rows that read DERIVED's values in place of their own key's
READ_DERIVED = ("dataloader.batch_size", "device")


def _keys_read(key: str) -> tuple[str, ...]:
    if key in READ_DERIVED:
        return ()
    extra = {"precision.name": ("precision.recipe",), "loss.name": ("loss.chunk_size",)}
    return (key, *extra.get(key, ()))


def _is_a(value: Any, kinds: tuple[type, ...]) -> bool:
    """isinstance, where a bool is no number (True is an int to Python)."""
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _fits(key: str, value: Any, default: Any) -> bool:
    if key in CHOICE_KEYS:
        return value in CHOICE_KEYS[key] and isinstance(value, str)
    if key in KINDS:
        return _is_a(value, KINDS[key])
    if isinstance(default, bool):
        return _is_a(value, (bool,))
    if isinstance(default, (int, float)):
        return _is_a(value, (int, float)) and (not isinstance(value, float) or value == value)  # no NaN
    return False
