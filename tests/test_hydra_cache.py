"""The compositions the test processes keep (hydra_cache.py) are Hydra's own: the same
configuration, the same flags, the same errors, a file edited in between read again, and
``${now:}`` resolved when each composition is used."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import hydra_cache
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from perfrun.config import config_dir, register_configs

# group choices, values, a sweep and its rungs, Hydra's own groups and keys, deletions, and
# overrides that fail (each in its own way)
OVERRIDES = [
    [], ["model.n_layer=2", "seed=3"], ["data=text", "model=gpt2", "model.n_layer=3"],
    ["+sweep=ablation", "+ablation=bf16", "device=cuda"], ["+sweep=ablation", "+ablation=compile", "device=cuda"],
    ["precision=bf16", "compile=true", "~logger"],
    ["hydra/launcher=submitit_local", "hydra.run.dir=/tmp/elsewhere"], ["model=nope"], ["+model.n_layer=2"],
]


def _composed(overrides: list[str], mode: RunMode = RunMode.RUN) -> dict[str, Any]:
    """The composition (with its ``hydra`` node) as comparable values, or its error."""
    try:
        if mode == RunMode.RUN:
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        else:
            loader = GlobalHydra.instance().config_loader()
            cfg = loader.load_configuration("train", overrides, run_mode=mode)
    except Exception as e:  # noqa: BLE001 - the error is what is compared
        return {"error": f"{type(e).__name__}: {e}"}
    # and every flag set on the root itself (a merge's own flag, left set, is not Hydra's)
    flags = [OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg), OmegaConf.is_readonly(cfg.hydra),
             sorted((k, v) for k, v in cfg._metadata.flags.items() if v is not None)]
    return {"yaml": OmegaConf.to_yaml(cfg), "flags": flags, "run dir": str(cfg.hydra.run.dir)}


def _but_the_time(composed: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in composed.items() if k != "run dir"}


@pytest.fixture
def conf(tmp_path: Path) -> Iterator[Path]:
    if not hydra_cache.active():
        pytest.skip("this Hydra's compositions are not kept (see the session's warning)")
    register_configs()
    folder = tmp_path / "conf"
    shutil.copytree(config_dir(), folder)
    with initialize_config_dir(config_dir=str(folder), version_base="1.3", job_name="train"):
        yield folder


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """Hydra's ``${now:}`` read from a clock that moves a minute at each reading."""
    import hydra.core.utils

    readings: list[datetime] = []

    class Clock:
        @staticmethod
        def now() -> datetime:
            readings.append(datetime(2026, 1, 1, 12, 0) + timedelta(minutes=len(readings)))
            return readings[-1]

    monkeypatch.setattr(hydra.core.utils, "datetime", Clock)
    return readings


class _Counted(dict):
    """The merges kept halfway, counting those taken up again."""

    taken = 0

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        self.taken += value is not None
        return value


def test_kept_compositions_equal_hydras_own(conf: Path, clock: list[datetime], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each composition made, then kept: equal to Hydra's. The second rung of the ladder
    starts from the first's merge up to the primary config, and a group choice from the
    merge of Hydra's own files before it."""
    failed = set()
    hydra_cache.forget()
    monkeypatch.setattr(hydra_cache, "_prefixes", halfway := _Counted())
    for overrides in OVERRIDES:
        with hydra_cache.hydras_own():
            hydras = _composed(overrides)
        first, again = _composed(overrides), _composed(overrides)  # made (or partly kept), then kept
        assert _but_the_time(first) == _but_the_time(again) == _but_the_time(hydras), overrides
        if "error" in hydras:
            failed.add(overrides[0])
        elif not any(o.startswith("hydra.run.dir=") for o in overrides):
            # the time each composition was made at (the clock moves a minute per reading)
            assert len({hydras["run dir"], first["run dir"], again["run dir"]}) == 3, overrides
    assert failed == {"model=nope", "+model.n_layer=2"}
    assert halfway.taken >= 2
    with hydra_cache.hydras_own():
        hydras = _composed(["+sweep=ablation"], RunMode.MULTIRUN)
    assert _but_the_time(_composed(["+sweep=ablation"], RunMode.MULTIRUN)) == _but_the_time(hydras)


def test_a_file_edited_between_compositions_is_read_again(conf: Path) -> None:
    before = compose("train", overrides=["model=gpt2"])
    (conf / "model" / "gpt2.yaml").write_text((conf / "model" / "gpt2.yaml").read_text().replace("n_layer: 12",
                                                                                                  "n_layer: 5"))
    (conf / "train.yaml").write_text((conf / "train.yaml").read_text().replace("  - data: pysource\n",
                                                                                  "  - data: text\n"))
    after = compose("train", overrides=["model=gpt2"])
    assert (before.model.n_layer, before.data.name) == (12, "pysource")
    assert (after.model.n_layer, after.data.name) == (5, "text")
    with hydra_cache.hydras_own():
        assert OmegaConf.to_yaml(compose("train", overrides=["model=gpt2"])) == OmegaConf.to_yaml(after)


def test_a_kept_node_keeps_the_class_it_was_made_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra's plugin scan executes a plugin's module again; a node made before keeps the
    class it was made with (as copy.deepcopy keeps it), which is what pickling it later
    (submitit pickles a job's config) checks against."""
    import dataclasses

    from hydra._internal.core_plugins import basic_sweeper

    made_with = basic_sweeper.BasicSweeperConf
    frozen = hydra_cache.Frozen(OmegaConf.structured(made_with))
    monkeypatch.setattr(basic_sweeper, "BasicSweeperConf", dataclasses.make_dataclass("BasicSweeperConf", []))
    assert OmegaConf.get_type(frozen.copy()) is made_with
