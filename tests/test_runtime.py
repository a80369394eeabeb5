"""``runtime``: the process-wide settings a job makes (perfrun/loop/runtime.py) are recorded
in its summary.json and undone at its end: a program that calls the library's ``run`` finds
its heap as it left it, frozen or not."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfrun.config import RuntimeConfig, TrainConfig
from perfrun.loop import host_heap
from perfrun.loop.run import run
from perfrun.summary import read_summary

from conftest import make_cfg

SHORT = ["max_steps=2", "eval_batches=1", "data=synthetic", "data.vocab_size=256"]


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The heap as a program that never called gc.freeze has it (the suite freezes what is
    alive when a test file starts); frozen again afterwards, as the suite had it, once the
    test has shown that its job left the heap unfrozen."""
    gc.unfreeze()
    yield
    assert gc.get_freeze_count() == 0
    gc.freeze()


def test_the_library_default_leaves_the_heap_as_it_is() -> None:
    assert TrainConfig().runtime == RuntimeConfig(gc="default", malloc="system")
    assert make_cfg(*SHORT, "runtime=default").runtime == RuntimeConfig(gc="default", malloc="system")


def test_a_frozen_heap_is_undone_after_the_job_and_recorded(tmp_path: Path, unfrozen: None) -> None:
    cfg = make_cfg(*SHORT, "runtime=tuned", "runtime.gc=freeze", "device=cpu")  # TINY says gc=default
    assert cfg.runtime == RuntimeConfig(gc="freeze", malloc="fixed")
    run(cfg, tmp_path)
    assert gc.get_freeze_count() == 0  # the job's freeze is not the caller's
    recorded = read_summary(tmp_path)
    assert recorded["config"]["runtime"] == {"gc": "freeze", "malloc": "fixed"}
    assert recorded["runtime"]["gc"] == "freeze" and recorded["runtime"]["gc_frozen"] is True
    assert recorded["runtime"]["malloc"] == "fixed" and isinstance(recorded["runtime"]["heap"]["set"], bool)


def test_the_default_neither_freezes_nor_sets_the_heap(tmp_path: Path, unfrozen: None) -> None:
    run(make_cfg(*SHORT, "runtime.gc=default", "runtime.malloc=system"), tmp_path)
    assert gc.get_freeze_count() == 0
    recorded = read_summary(tmp_path)["runtime"]
    left = host_heap.lasting_change()  # an earlier test's job in this process may have fixed the thresholds
    heap = None if left is None else {"set": False, "why": left}
    assert recorded == {"gc": "default", "gc_frozen": False, "malloc": "system", "heap": heap}


def test_a_heap_the_caller_froze_stays_as_the_caller_froze_it(tmp_path: Path, unfrozen: None) -> None:
    gc.freeze()  # the caller's own freeze, which it undoes itself
    frozen = gc.get_freeze_count()
    try:
        run(make_cfg(*SHORT, "runtime.gc=freeze"), tmp_path)
        # neither unfrozen (0) nor frozen further (more); objects frozen before may die meanwhile
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    recorded = read_summary(tmp_path)["runtime"]
    assert recorded["gc_frozen"] is False and "frozen already" in recorded["gc_why"]


def test_an_unknown_setting_is_refused_in_one_line() -> None:
    from perfrun.config import ConfigError
    from perfrun.validate import validate

    with pytest.raises(ConfigError, match=r"runtime.gc=sometimes is not an option; choose one of default, freeze"):
        validate(make_cfg("runtime.gc=sometimes"))
