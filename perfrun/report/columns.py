"""The column specification: each column of the runs table and of the ablation table is
defined once here (its CSV name, its heading, how to get its value, how to format it), and
every renderer (rich, HTML, Markdown, CSV) walks the same list. A column that is n/a for
every row is left out of every format alike (:func:`shown`).

Two columns are the CSV's alone, because a spreadsheet wants them apart and a table does
not: one column per swept key (the tables show them together in ``overrides`` as
``key=value``), and ``reason`` (the tables list each failure's reason under the table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from perfrun.report.rows import Report, Row, finite

NA = "n/a"


def fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    """A figure as the tables show it, or n/a."""
    return format(v * scale, spec) if finite(v) else NA


def is_na(v: Any) -> bool:
    """No figure: absent, not a finite number, or said to be n/a."""
    return v is None or v == NA or (isinstance(v, float) and not finite(v))


@dataclass(frozen=True)
class Column:
    """One column in every format: ``name`` heads the CSV, ``header`` the tables."""

    name: str
    header: str
    value: Callable[[Any], Any]  # the raw value of a row (the CSV writes it at full precision)
    spec: str = ""  # format spec of the tables' cell ("": the value as text)
    scale: float = 1.0
    suffix: str = ""  # after a formatted figure (×)
    text: Callable[[Any], str] | None = None  # the tables' cell, where it is not the formatted value
    justify: Literal["left", "right"] = "right"
    tables: bool = True  # False: the CSV's alone (see the module doc)

    def cell(self, row: Any) -> str:
        """The tables' text for ``row``."""
        if self.text is not None:
            return self.text(row)
        v = self.value(row)
        if self.spec:
            return fmt(v, self.spec, self.scale) + (self.suffix if finite(v) else "")
        return NA if v is None else str(v)

    def csv(self, row: Any) -> Any:
        """The CSV's field for ``row``: the full-precision value, empty where there is none."""
        v = self.value(row)
        return "" if v is None or (isinstance(v, float) and not finite(v)) else v


def shown(columns: Sequence[Column], rows: Sequence[Any], *, tables: bool) -> list[Column]:
    """The columns one format shows: those with a figure in some row (all of them for no
    rows), and for the tables only those that are not the CSV's alone."""
    return [c for c in columns if (c.tables or not tables) and (not rows or not all(is_na(c.value(r)) for r in rows))]


def overrides_cell(r: Row, keys: Sequence[str]) -> str:
    """The tables' overrides: the swept keys as key=value, or every override when none varies."""
    keys = [k for k in keys if k != "source"]
    if keys:
        return " ".join(f"{k}={'—' if r.swept.get(k) is None else r.swept[k]}" for k in keys)
    return " ".join(r.overrides) or "(defaults)"


def run_columns(report: Report) -> list[Column]:
    """The runs table: one row per job."""
    swept = [Column(k, k, lambda r, k=k: r.swept.get(k), tables=False) for k in report.swept_keys]
    return [
        Column("best", "", lambda r: r.best, text=lambda r: "★" if r.best else "", justify="left"),
        Column("job", "job", lambda r: r.job, justify="left"),
        *swept,
        Column("overrides", "overrides", lambda r: " ".join(r.overrides),
               text=lambda r: overrides_cell(r, report.swept_keys), justify="left"),
        Column("status", "status", lambda r: r.status, justify="left"),
        Column("tokens_per_s", "tok/s", lambda r: r.tokens_per_s, ",.0f"),
        Column("mfu", "MFU %", lambda r: r.mfu, ".1f", scale=100),
        Column("peak_mem_mib", "peak MiB", lambda r: r.peak_mem_mib, ",.0f"),
        Column("data_wait_pct", "data-wait %", lambda r: r.data_wait_pct, ".1f"),
        Column("final_train_loss", "train loss", lambda r: r.final_train_loss, ".4f"),
        Column("final_val_loss", "val loss", lambda r: r.final_val_loss, ".4f"),
        Column("first_step_s", "first step s", lambda r: r.first_step_s, ".2f"),
        Column("reason", "reason", lambda r: r.reason, tables=False),
    ]


def run_mark(r: Row) -> str | None:
    """How a job's row stands out: the best, or one that did not complete."""
    return "best" if r.best else ("bad" if r.status != "completed" else None)


ABLATION_COLUMNS = [
    Column("knob", "knob", lambda k: k["knob"], justify="left"),
    Column("status", "status", lambda k: k["status"], justify="left"),
    Column("tokens_per_s", "tok/s", lambda k: k["tokens_per_s"], ",.0f"),
    Column("speedup", "speed-up", lambda k: k["speedup"], ".2f", suffix="×"),
    Column("peak_mem_mib", "peak MiB", lambda k: k["peak_mem_mib"], ",.0f"),
    Column("mem_ratio", "mem ratio", lambda k: k["mem_ratio"], ".2f", suffix="×"),
    Column("first_step_s", "first step s", lambda k: k["first_step_s"], ".2f"),
    Column("loss", "tail loss", lambda k: k["loss"], ".4f"),
    Column("loss_rel_diff", "Δ loss", lambda k: k["loss_rel_diff"], "+.2%"),
    Column("loss_max_rel_diff", "max Δ", lambda k: k["loss_max_rel_diff"], ".2%"),
    Column("parity", "parity", lambda k: k["parity"], justify="left"),
]


def ablation_mark(k: dict[str, Any]) -> str | None:
    """A knob over the loss tolerance is flagged; one that did not complete is marked bad."""
    return "flagged" if k["parity"] == "EXCEEDED" else ("bad" if k["status"] != "completed" else None)
