"""``perfrun tune``'s configuration: the trainer's (conf/train.yaml, as ``perfrun train``
composes it) with tune's own options typed under ``tune`` (conf/tune.yaml), and the
command-line flags (``--quick``, ``--steps N``, ...) kept as spellings of those keys.

So ``perfrun tune --help`` lists every key, ``--cfg job`` prints the composed tree, and a
bad key or value is one line, as for ``perfrun train``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from perfrun.config import CHOICES, TrainConfig
from perfrun.console import hydra_quoted


class TuneError(ValueError):
    """Bad input to ``perfrun tune``: one line, exit 2."""


def default_workers() -> int:
    """The worker count worth trying on this machine: half its cores, one to four."""
    return min(4, max(1, (os.cpu_count() or 2) // 2))


@dataclass
class TuneConfig:
    """The search and its trials (``tune.KEY=VALUE``); null means the default named."""

    quick: bool = False  # batch size only (no checkpointing, eager, no workers) and shorter trials
    steps: int | None = None  # optimizer steps per trial (null: 10; 6 with quick)
    warmup: int | None = None  # first steps of a trial kept out of its figure (null: 3; 2 with quick)
    batch_sizes: list[int] | None = None  # the batch sizes to climb, e.g. [4,8,16] (null: doubling from start)
    start: int = 1  # first batch size of the doubling ladder
    max_batch: int | None = None  # largest batch size to try (null: until a trial fails)
    checkpointing: list[str] | None = None  # options to try (null: [none,full]; [none] with quick)
    compile: list[bool] | None = None  # options to try (null: [false,true]; [false] with quick)
    workers: list[int] | None = None  # DataLoader workers to try (null: [0, half the cores]; [0] with quick)
    patience: int = 1  # sizes without gain before a ladder stops
    min_gain: float = 0.02  # relative tokens/s gain that counts as progress
    json: bool = False  # the result as JSON on stdout; the trial lines go to stderr, no table


@dataclass
class TuneJobConfig(TrainConfig):
    """The whole tree of ``perfrun tune``: the trainer's keys and ``tune``."""

    tune: TuneConfig = field(default_factory=TuneConfig)


def register_tune_schema() -> None:
    """Store ``tune_schema`` (conf/tune.yaml lists it after ``train``): it types the ``tune``
    node and leaves the trainer's keys as train composed them. Those are MISSING in this
    node, and merging MISSING keeps the value already there; with the dataclass's own
    defaults instead, it would undo every group choice (``model=gpt2``) made before it.
    Once per process: the node never changes, and building it is not free."""
    store = ConfigStore.instance()
    if "tune_schema.yaml" in store.repo:
        return
    node = OmegaConf.structured(TuneJobConfig)
    for f in fields(TrainConfig):
        node[f.name] = MISSING
    store.store(name="tune_schema", node=node)


# ------------------------------------------------------------------------------- flags


class _Flags(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise TuneError(f"{message} (perfrun tune --help)")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 0, e.g. 0,2")
    return values


def _bools(text: str) -> list[bool]:
    table = {"true": True, "false": False}
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not values or any(v not in table for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give false, true or false,true")
    return [table[v] for v in values]


def _names(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    allowed = CHOICES["checkpointing.name"]
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
    return values


# flag -> (its key, how its value is read); a flag without a reader is a switch (key=true)
FLAGS: dict[str, tuple[str, Any]] = {
    "--quick": ("tune.quick", None),
    "--json": ("tune.json", None),
    "--steps": ("tune.steps", int),
    "--warmup": ("tune.warmup", int),
    "--batch-sizes": ("tune.batch_sizes", _ints),
    "--start": ("tune.start", int),
    "--max-batch": ("tune.max_batch", int),
    "--checkpointing": ("tune.checkpointing", _names),
    "--compile": ("tune.compile", _bools),
    "--workers": ("tune.workers", _ints),
    "--patience": ("tune.patience", int),
    "--min-gain": ("tune.min_gain", float),
    "--out": ("hydra.run.dir", str),
}


def override_value(value: Any) -> str:
    """A flag's value as a Hydra override value: [4,8], [none,full], true, a quoted path."""
    if isinstance(value, list):
        return "[" + ",".join(str(v).lower() if isinstance(v, bool) else str(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):  # a path: quoted, so that = , spaces, quotes and ${ stay part of it
        return hydra_quoted(value)
    return str(value)


def flags_to_overrides(argv: list[str]) -> list[str]:
    """The command line with tune's flags replaced by the overrides they spell
    (``--steps 5`` -> ``tune.steps=5``, ``--out D`` -> ``hydra.run.dir='D'``), in place."""
    p = _Flags(prog="perfrun tune", add_help=False, allow_abbrev=False)
    for flag, (_, read) in FLAGS.items():
        if read is None:
            p.add_argument(flag, action="store_true", default=None)
        else:
            p.add_argument(flag, type=read)
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in FLAGS:
            out.append(argv[i])
            i += 1
            continue
        key, read = FLAGS[flag]
        take = 1 if read is None or "=" in argv[i] else 2
        args = p.parse_args(argv[i:i + take])
        out.append(f"{key}={override_value(getattr(args, flag.lstrip('-').replace('-', '_')))}")
        i += take
    return out
