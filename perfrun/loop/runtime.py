"""Process-wide settings a job makes for itself (``runtime``), recorded in its summary and
undone at its end, so that a later job, or the program that called :func:`perfrun.loop.run.run`,
finds the process as it was.

- ``runtime.gc=freeze``: what is alive when the job starts (torch's, its compiler's and
  Hydra's objects, and the caller's) is moved out of the collector's sight
  (``gc.freeze``) for the job, so that its collections, and the full one at its end, walk
  only what the job made; unfrozen at the end. Left alone where the heap is frozen already:
  Python unfreezes all or nothing, so a freeze that is not the job's is not the job's to undo.
- ``runtime.malloc=fixed``: glibc's heap thresholds fixed for a CPU job
  (:mod:`perfrun.loop.host_heap`), glibc's starting values put back at the end.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from perfrun.config import RuntimeConfig
from perfrun.loop import host_heap


@contextmanager
def frozen_heap(settings: RuntimeConfig) -> Iterator[dict[str, Any]]:
    """``runtime.gc`` for the life of a job; yields what was done, for summary.json."""
    done: dict[str, Any] = {"gc": settings.gc, "gc_frozen": False}
    if settings.gc == "freeze":
        if gc.get_freeze_count():
            done["gc_why"] = "the heap was frozen already (gc.freeze) by the program that runs the job"
        else:
            gc.freeze()
            done["gc_frozen"] = True
    try:
        yield done
    finally:
        if done["gc_frozen"]:
            gc.unfreeze()


@contextmanager
def fixed_heap(settings: RuntimeConfig, device_type: str) -> Iterator[dict[str, Any]]:
    """``runtime.malloc`` for the life of a job on ``device_type``; yields what was done."""
    done: dict[str, Any] = {"malloc": settings.malloc, "heap": None}
    if settings.malloc == "system" and (left := host_heap.lasting_change()) is not None:
        done["heap"] = {"set": False, "why": left}
    if settings.malloc == "fixed":
        done["heap"] = host_heap.fix_thresholds() if device_type == "cpu" else \
            {"set": False, "why": f"a {device_type} job: the thresholds are set for CPU jobs, whose steps allocate "
                                  "their tensors from the C heap"}
    try:
        yield done
    finally:
        if done["heap"] and done["heap"]["set"]:
            host_heap.restore_thresholds()
