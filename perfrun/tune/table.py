"""The trials of ``perfrun tune`` as a table, through the report's column specification."""

from __future__ import annotations

from typing import Any

from perfrun.report.columns import Column
from perfrun.report.render import rich_table
from perfrun.tune.search import TuneResult


def trials_table(result: TuneResult) -> Any:
    """Every trial, the winner starred, through the report's column specification."""
    best = result.winner.tokens_per_s if result.winner else None
    number = {id(r): i for i, r in enumerate(result.trials)}
    columns = [
        Column("best", "", lambda r: r is result.winner, text=lambda r: "★" if r is result.winner else "",
               justify="left"),
        Column("trial", "#", lambda r: number[id(r)]),
        Column("phase", "phase", lambda r: r.phase, justify="left"),
        Column("batch", "batch", lambda r: r.candidate.batch_size),
        Column("checkpointing", "checkpointing", lambda r: r.candidate.checkpointing, justify="left"),
        Column("compile", "compile", lambda r: str(r.candidate.compile).lower(), justify="left"),
        Column("workers", "workers", lambda r: r.candidate.num_workers),
        Column("status", "status", lambda r: r.status, justify="left"),
        Column("tokens_per_s", "tok/s", lambda r: r.tokens_per_s, ",.0f"),
        Column("vs_best", "vs best", lambda r: r.tokens_per_s / best if (r.tokens_per_s and best) else None, ".2f"),
        Column("peak_mem_mib", "peak MiB", lambda r: r.peak_mem_mib, ",.0f"),
        Column("step_time_ms", "step ms", lambda r: r.step_time_ms, ".1f"),
        Column("first_step_s", "first step s", lambda r: r.first_step_s, ".2f"),
    ]
    return rich_table(columns, result.trials, lambda r: "best" if r is result.winner else (None if r.ok else "bad"),
                      title="perfrun tune: trials",
                      caption="★ highest tokens/s (median of the steady steps of each trial)")
