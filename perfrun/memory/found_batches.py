"""The batch searches a sweep has made (``dataloader.batch_size=auto``), by configuration:
a repeat of the same job takes the batch its first repeat found instead of searching again.
The memory one step takes does not change from one repeat to the next; the repeats measure
speed. Imports nothing heavy: the sweep holds one before any job imports torch."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("perfrun")


class FoundBatches:
    """Search results by configuration (:meth:`key`) and device; each
    reused result names the job whose search found it (``searched_by`` in summary.json)."""

    def __init__(self) -> None:
        self._notes: dict[str, dict[str, Any]] = {}

    @staticmethod
    def key(config: dict[str, Any], device: object) -> str:
        """The configuration on this device, without what differs between repeats and does not
        change a step's memory: the repeat's number, and whether repeat 0 tracked the memory."""
        memory = {k: v for k, v in (config.get("memory") or {}).items() if k != "breakdown"}
        kept = {k: v for k, v in config.items() if k not in ("repeat", "memory")}
        return json.dumps([str(device), kept, memory], sort_keys=True, default=str)

    def reuse_or_search(self, key: str, search: Callable[[], dict[str, Any]], job: str) -> dict[str, Any]:
        """The search's notes for this configuration: an earlier job's (``search_s`` 0), else
        ``search()``'s, kept for the next repeat."""
        if key in self._notes:
            notes = {**self._notes[key], "search_s": 0.0}
            log.info(f"batch_size=auto: {notes['batch_size']}, as the search of {notes['searched_by']} found with the "
                     "same configuration (one step's memory is the same in every repeat)")
            return notes
        notes = {**search(), "searched_by": job}
        self._notes[key] = notes
        return notes
