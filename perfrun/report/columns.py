"""The column specification: each column of the runs, repeats and ladder tables is
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

from perfrun.console import fmt
from perfrun.report.noise import Effect, Spread
from perfrun.report.rows import Report, Row, finite

NA = "n/a"


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
    # a terminal too narrow for the table drops the columns of lowest keep first (0: first to
    # go); the HTML, Markdown and CSV keep every column
    keep: int = 5

    def cell(self, row: Any) -> str:
        """The tables' text for ``row``."""
        if self.text is not None:
            return self.text(row)
        v = self.value(row)
        if self.spec:
            return fmt(v, self.spec, scale=self.scale, unit=self.suffix, missing=NA)
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
        Column("job", "job", lambda r: r.job, justify="left", keep=9),
        *swept,
        Column("overrides", "overrides", lambda r: " ".join(r.overrides),
               text=lambda r: overrides_cell(r, report.swept_keys), justify="left", keep=9),
        Column("status", "status", lambda r: r.status, justify="left", keep=7),
        Column("tokens_per_s", "tok/s", lambda r: r.tokens_per_s, ",.0f", keep=9),
        Column("mfu", "MFU %", lambda r: r.mfu, ".1f", scale=100, keep=6),
        Column("peak_mem_mib", "peak MiB", lambda r: r.peak_mem_mib, ",.0f", keep=4),
        Column("host_data_wait_pct", "host data-wait %", lambda r: r.host_data_wait_pct, ".1f", keep=2),
        Column("gpu_starved_pct", "GPU starved %", lambda r: r.gpu_starved_pct, ".1f", keep=3),
        Column("contended", "contended", lambda r: r.contended, text=lambda r: "yes" if r.contended else
               ("no" if r.contended is False else "unknown" if r.machine_unknown else NA), justify="left", keep=8),
        Column("final_train_loss", "train loss", lambda r: r.final_train_loss, ".4f", keep=3),
        Column("final_val_loss", "val loss", lambda r: r.final_val_loss, ".4f", keep=4),
        Column("first_step_s", "first step s", lambda r: r.first_step_s, ".2f", keep=1),
        Column("reason", "reason", lambda r: r.reason, tables=False),
    ]


def run_mark(r: Row) -> str | None:
    """How a job's row stands out: the best, or one that did not complete or shared the machine."""
    return "best" if r.best else ("bad" if r.status not in ("completed", "skipped") or r.contended
                                  or r.machine_unknown else None)


def _tps_cell(e: dict[str, Any]) -> str:
    """A rung's tokens/s: the median of its repeats and their spread, or why there is none."""
    if not e.get("applicable", True):
        return NA
    return Spread(e["n"], e["tokens_per_s"], e["tokens_per_s_min"], e["tokens_per_s_max"]).text()


def _effect_cell(e: dict[str, Any], key: str) -> str:
    if not e.get("applicable", True) or e.get(key) is None:
        return NA
    return Effect(e[key], e[f"{key}_noise_pct"], e[f"{key}_measurable"], e.get(f"{key}_single", False)).text()


def _runs_cell(e: dict[str, Any]) -> str:
    return f"{e['n']}" + (f" (+{e['contended']} contended)" if e["contended"] else "") + \
        (f" (+{e['unknown']} unknown)" if e.get("unknown") else "") + \
        (f" (+{e['failed']} failed)" if e["failed"] else "") + \
        (f" (+{len(e['outliers'])} outlier)" if e.get("outliers") else "")


def _rung_columns(first: str, against: str) -> list[Column]:
    return [
        Column("rung", first, lambda e: e["rung"], justify="left", keep=9),
        Column("runs", "runs", lambda e: e["n"], text=_runs_cell, keep=3),
        Column("tokens_per_s", "tok/s (median ±½ range)", lambda e: e["tokens_per_s"], text=_tps_cell, keep=8),
        # the verdict of a measured rung is its effect against the one below: this column goes first
        Column("vs_below", against, lambda e: e["vs_below"], text=lambda e: _effect_cell(e, "vs_below"), keep=0),
        Column("vs_baseline", "vs naive", lambda e: e["vs_baseline"], text=lambda e: _effect_cell(e, "vs_baseline"),
               keep=4),
        # shown only where the naive trainer's speed does not stand (missing or contended)
        Column("vs_reference", "vs fastest uncontended", lambda e: e.get("vs_reference"),
               text=lambda e: _effect_cell(e, "vs_reference"), keep=4),
        Column("peak_mem_mib", "peak MiB", lambda e: e["peak_mem_mib"], ",.0f", keep=2),
        Column("first_step_s", "first step s", lambda e: e["first_step_s"], ".2f", keep=1),
        Column("loss_rel_diff", "Δ loss", lambda e: e["loss_rel_diff"], "+.2%", keep=3),
        Column("parity", "parity", lambda e: e.get("parity"), justify="left", keep=6),
        Column("verdict", "verdict", lambda e: e["verdict"], justify="left", keep=9),
    ]


LADDER_COLUMNS = _rung_columns("rung", "vs rung below")
ALTERNATIVE_COLUMNS = _rung_columns("alternative", "vs rung below")
LEAVE_ONE_OUT_COLUMNS = _rung_columns("top without", "vs top")
TRADEOFF_COLUMNS = [
    Column("setting", "setting", lambda t: t["setting"], justify="left"),
    Column("peak_mem_mib", "peak MiB", lambda t: t.get("peak_mem_mib"), ",.0f"),
    Column("tokens_per_s", "tok/s", lambda t: t.get("tokens_per_s"),
           text=lambda t: Spread(t.get("n") or 0, t.get("tokens_per_s"), None, None).text() if t.get("n", 0) < 2 else
           f"{t['tokens_per_s']:,.0f} ±{t['spread_pct']:.1f}%"),
    Column("largest_batch", "largest batch", lambda t: t.get("largest_batch"), ",.0f"),
    Column("tokens_per_s_at_largest", "tok/s at it", lambda t: t.get("tokens_per_s_at_largest"), ",.0f"),
]
GROUP_COLUMNS = [
    Column("best", "", lambda g: g.best, text=lambda g: "★" if g.best else "", justify="left"),
    Column("jobs", "jobs", lambda g: ",".join(g.jobs), justify="left"),
    Column("overrides", "overrides", lambda g: " ".join(g.overrides) or "(defaults)", justify="left"),
    Column("runs", "runs", lambda g: g.tps.n,
           text=lambda g: f"{g.tps.n}" + (f" (+{g.contended} contended)" if g.contended else "")
           + (f" (+{g.unknown} unknown)" if g.unknown else "")),
    Column("tokens_per_s", "tok/s (median ±½ range)", lambda g: g.tps.median, text=lambda g: g.tps.text()),
    Column("verdict", "vs best", lambda g: g.verdict or None, justify="left"),
]


def rung_mark(e: dict[str, Any]) -> str | None:
    """A rung over the loss tolerance is flagged; one not measured is marked bad."""
    return "flagged" if e.get("parity") == "FLAGGED" else ("bad" if e.get("n") == 0 and e.get("applicable", True)
                                                           else None)


def group_mark(g: Any) -> str | None:
    return "best" if g.best else None
