"""A job's metrics.jsonl as the run that ended sees it.

A job that continues a run (``resume``) first writes ``{"kind": "start", "step": N}``: the
rows before it of steps after N were trained again, so they are dropped here. A line cut by
a crash is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def train_records(job: Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of ``kind`` (``train``, ``eval``) of ``job``'s metrics.jsonl, one per step,
    in step order; empty when there is no file."""
    try:
        lines = (Path(job) / METRICS).read_text().splitlines()
    except OSError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(r, dict) or not isinstance(r.get("step"), int):
            continue
        if r.get("kind") == "start":
            by_step = {s: row for s, row in by_step.items() if s <= r["step"]}
        elif r.get("kind") == kind:
            by_step[r["step"]] = r  # the same step again: the later record wins
    return [by_step[s] for s in sorted(by_step)]
