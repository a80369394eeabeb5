"""What a job leaves to the next one in the same process (a sweep's): after a job that ended
well, what survived its collection is frozen out of the collector's sight, so the next job's
collections scan only what it made; after a failed job nothing is frozen (its traceback's
frames may still hold its tensors, which must stay collectable)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from perfrun.loop.run import RunFailed, run

from conftest import make_cfg


def test_a_failed_job_unfreezes_the_heap_it_froze(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.gc=freeze on a heap no one froze (tests/test_runtime.py has a completed job):
    a job that fails leaves nothing frozen, and what survived its collection (its traceback's
    frames may hold its tensors) stays in the collector's sight."""
    from perfrun.loop import schedule

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("a planted failure in the loop")

    monkeypatch.setattr(schedule.TrainStep, "__call__", broken)
    gc.unfreeze()  # the suite freezes what is alive when a file starts (tests/conftest.py)
    try:
        with pytest.raises(RunFailed, match="planted failure"):
            run(make_cfg("max_steps=2", "log_every=1", "runtime.gc=freeze"), tmp_path / "failed")
        assert gc.get_freeze_count() == 0 and gc.get_objects(generation=2)
    finally:
        gc.freeze()
