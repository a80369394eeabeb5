"""The ``memory`` piece of the configuration (``memory.breakdown``, ``memory.estimate``,
``memory.size``), apart from perfrun/config.py so that it imports nothing of perfrun."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryConfig:
    """Where the memory goes (perfrun/telemetry/memory_breakdown.py) and whether it will fit
    (perfrun/memory/): the tracked step of a run, the estimate said before step 1."""

    breakdown: bool = False  # one step after the warm-up runs under torch's memory tracker
    estimate: bool | None = None  # the estimate in the log's first lines; null: on CUDA only
    size: str | None = None  # the memory to fit into, e.g. 80GiB; null: the visible GPU's
