"""Every option perfrun lists is accepted as a user types it.

Hydra's override grammar reads ``true``, ``false`` and numbers as such, and OmegaConf stores
them in a string key as ``True``, ``False``, ``1.0``; ``optim.fused=true`` was refused as
"optim.fused=True is not an option". The options come from where a user reads them: the
groups ``perfrun train --help`` lists, the options its error lines list (``CHOICES``), every
boolean key, and README's knob table. Each is composed with Hydra's public compose API
(conftest's ``make_cfg``), typed, and checked by ``validate``: it must hold the option as
typed and never be called "not an option".
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from perfrun.config import (
    CHOICES,
    INTERNAL_GROUPS,
    ConfigError,
    TrainConfig,
    as_option,
    config_dir,
    group_listing,
    select,
)
from perfrun.validate import validate

from conftest import REPO, make_cfg


def _leaves(schema: type, prefix: str = "") -> dict[str, typing.Any]:
    """Dotted key -> type of every leaf of a dataclass schema."""
    hints = typing.get_type_hints(schema)
    out: dict[str, typing.Any] = {}
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(_leaves(kind, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out[prefix + f.name] = kind
    return out


LEAVES = _leaves(TrainConfig)
BOOL_KEYS = [k for k, kind in LEAVES.items() if kind in (bool, bool | None)]
GROUPS = {p.name for p in Path(config_dir()).iterdir() if p.is_dir()} - set(INTERNAL_GROUPS)


def help_options() -> list[str]:
    """``group=option`` for each line ``group: a, b`` of ``perfrun train --help``."""
    out = []
    for line in group_listing().splitlines():
        group, _, options = line.partition(": ")
        prefix = "+" if group == "sweep" else ""  # README: perfrun train -m +sweep=ablation
        out += [f"{prefix}{group}={o}" for o in options.split(", ")]
    return out


def readme_options() -> list[str]:
    """The overrides README's knob table spells out: ``KEY=OPTION`` for each backticked
    option of a row whose first cell names a group or a key (or of the ``key=value`` before
    it in the cell), and each backticked ``key=value`` in either cell."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| group / key | options |"):]
    table = table[:table.index("\n\n")]
    out = []
    for row in table.splitlines()[2:]:
        first, options = row.split(" | ")[:2]
        named = re.findall(r"`([^`]+)`", first)
        out += [n for n in named if "=" in n]
        key = named[0] if named else ""
        for token in re.findall(r"`([^`]+)`", options):
            if "=" in token:  # `precision.recipe=tensorwise` \| `rowwise`: the next bare options are its key's
                out.append(token)
                key = token.partition("=")[0]
            elif key in LEAVES or (key in GROUPS and f"{key}.{token}" not in LEAVES):  # a group's keys are no options
                out.append(f"{key}={token}")
    return out


def choice_options() -> list[str]:
    return [f"{key}={option}" for key, options in CHOICES.items() for option in options]


SPELLINGS = ("true", "false", "True", "False")  # how a boolean is typed


def bool_options() -> list[str]:
    return [f"{key}={value}" for key in BOOL_KEYS for value in SPELLINGS]


def test_the_lists_are_read() -> None:
    """The sources hold what a user sees (the test would pass vacuously otherwise)."""
    assert "precision=bf16" in help_options() and "model=llama-tiny" in help_options()
    assert {"compile=true", "attention=eager", "distributed=fsdp", "precision.recipe=rowwise",
            "compile_options.mode=max-autotune"} <= set(readme_options())
    assert {"optim.fused=true", "optim.fused=false", "optim.fused=auto"} <= set(choice_options())
    assert "compile=true" in bool_options() and "dataloader.device_input=false" in bool_options()


def listed_by_key() -> dict[str, list[str]]:
    """Each listed option (but the booleans, below) under its key: a group or a dotted key."""
    by_key: dict[str, list[str]] = {}
    for override in sorted({*help_options(), *readme_options(), *choice_options()} - set(bool_options())):
        by_key.setdefault(override.lstrip("+").partition("=")[0], []).append(override)
    return by_key


LISTED = listed_by_key()


@pytest.mark.parametrize("k", range(max(map(len, LISTED.values()))))
def test_every_listed_option_is_accepted_as_typed(k: int) -> None:
    """The k-th option of every key in one composition: Hydra reads each key's override
    alone, so composing one option of each key together tests each as it is typed."""
    overrides = [options[k] for options in LISTED.values() if k < len(options)]
    cfg = make_cfg(*overrides)
    for override in overrides:
        key, _, typed_value = override.lstrip("+").partition("=")
        if key in CHOICES:  # what validate's "is not an option" checks: the option, as typed
            assert select(cfg, key) == typed_value, f"{override} became {select(cfg, key)!r}"
    try:
        validate(cfg)
    except ConfigError as e:  # another rule may refuse the mix (a CUDA-only knob on the CPU), never a spelling
        assert "is not an option" not in str(e), f"{overrides}: {e}"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_boolean_key_is_accepted_in_each_spelling(spelling: str) -> None:
    """Every boolean key typed one way, in one composition: Hydra reads each alone (a boolean
    is no group option), so composing them together tests the same spelling of each."""
    cfg = make_cfg(*(f"{key}={spelling}" for key in BOOL_KEYS))
    assert {key: select(cfg, key) for key in BOOL_KEYS} == dict.fromkeys(BOOL_KEYS, spelling.lower() == "true")


def test_an_option_is_found_by_what_it_means() -> None:
    """What OmegaConf makes of a typed option in a string key, mapped back; anything else kept
    for validate to refuse (an option list of numbers, as a future key may have, included)."""
    assert as_option("True", ("auto", "true", "false")) == "true"
    assert as_option("False", ("auto", "true", "false")) == "false"
    assert as_option("1.0", ("1", "2")) == "1" and as_option("2", ("1.5", "2.0")) == "2.0"
    assert as_option("maybe", ("auto", "true", "false")) == "maybe"
    assert as_option("True", ("on", "off")) == "True"  # no guessing beyond the spelling
