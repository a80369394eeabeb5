"""The report in each format: the rich tables on the console, CSV, JSON, a static HTML page
and Markdown. The tables' columns come from :mod:`perfrun.report.columns`; what differs
here is only the medium (a title or a caption, escaping, how a row stands out).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text  # cells from files are shown as written, never read as rich markup

from perfrun.atomic import json_safe
from perfrun.console import wide_console
from perfrun.report.columns import (
    ABLATION_COLUMNS,
    Column,
    ablation_mark,
    run_columns,
    run_mark,
    shown,
)
from perfrun.report.plot import PLOT_HINT
from perfrun.report.rows import Report, Row

Mark = Callable[[Any], "str | None"]
RICH_STYLES = {"best": "bold green", "bad": "red", "flagged": "bold red"}
HTML_CLASSES = {"best": "best", "bad": "bad", "flagged": "bad"}
BEST_CAPTION = "★ best tokens/s (median of steady steps)"


# ------------------------------------------------------------------------------- one table, each medium


def rich_table(columns: Sequence[Column], rows: Sequence[Any], mark: Mark, **frame: Any) -> Table:
    """A rich Table of ``rows`` (``frame``: its title and caption)."""
    t = Table(caption_justify="left", **frame)
    shown_ = shown(columns, rows, tables=True)
    for c in shown_:
        t.add_column(c.header, justify=c.justify)
    for r in rows:
        t.add_row(*(Text(c.cell(r)) for c in shown_), style=RICH_STYLES.get(mark(r) or ""))
    return t


def html_table(columns: Sequence[Column], rows: Sequence[Any], mark: Mark, caption: str) -> str:
    """An HTML table of ``rows``, every cell escaped."""
    shown_ = shown(columns, rows, tables=True)

    def cells(tag: str, texts: Sequence[str]) -> str:
        opens = [f"<{tag} class='l'>" if c.justify == "left" else f"<{tag}>" for c in shown_]
        return "".join(f"{o}{html.escape(t)}</{tag}>" for o, t in zip(opens, texts, strict=True))

    lines = ["<table><tr>" + cells("th", [c.header for c in shown_]) + "</tr>"]
    lines += [f"<tr class='{HTML_CLASSES.get(mark(r) or '', '')}'>" + cells("td", [c.cell(r) for c in shown_]) + "</tr>"
              for r in rows]
    lines.append(f"<caption>{html.escape(caption)}</caption></table>")
    return "\n".join(lines)


def markdown_row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def markdown_table(columns: Sequence[Column], rows: Sequence[Any]) -> list[str]:
    """GitHub Markdown lines of ``rows``."""
    shown_ = shown(columns, rows, tables=True)
    return [markdown_row([c.header for c in shown_]), markdown_row(["---"] * len(shown_)),
            *(markdown_row([c.cell(r) for c in shown_]) for r in rows)]


def csv_table(columns: Sequence[Column], rows: Sequence[Any]) -> str:
    """CSV of ``rows``: every column with a value in some row, at full precision."""
    shown_ = shown(columns, rows, tables=False)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([c.name for c in shown_])
    w.writerows([c.csv(r) for c in shown_] for r in rows)
    return buf.getvalue()


# ------------------------------------------------------------------------------- the report


def to_csv(report: Report) -> str:
    """One line per job: the job, the swept keys' values, the figures (full precision)."""
    return csv_table(run_columns(report), report.rows)


def to_dict(report: Report) -> dict[str, Any]:
    return {
        "swept_keys": report.swept_keys,
        "best": report.best,
        "rows": [asdict(r) for r in report.rows],
        "ablation": report.ablations,
    }


def to_json(report: Report) -> str:
    return json.dumps(json_safe(to_dict(report)), indent=2, default=str) + "\n"


def ablation_method(a: dict[str, Any]) -> str:
    return (
        f"loss parity: relative difference of the mean train loss over the last {a['loss_window']:.0%} of the "
        f"logged steps against the baseline (fp32) at the same steps; tolerance ±{a['loss_tol']:.1%}, "
        "EXCEEDED where over it"
    )


def shown_ablations(report: Report) -> list[dict[str, Any]]:
    """The ablations that have a table: knobs and a baseline job."""
    return [a for a in report.ablations if a["knobs"] and a["baseline"]]


def table(report: Report) -> Table:
    """The rich table: one row per job, the best marked with a star."""
    mem_sources = sorted({r.peak_mem_source for r in report.rows if r.peak_mem_source})
    return rich_table(run_columns(report), report.rows, run_mark, title="perfrun: runs",
                      caption=BEST_CAPTION + (f" · peak memory: {', '.join(mem_sources)}" if mem_sources else ""))


def ablation_table(a: dict[str, Any]) -> Table:
    """Per knob: speed-up, memory ratio, time to first step and loss parity against the baseline."""
    where = f" on {a['device_name']}" if a.get("device_name") else ""
    return rich_table(
        ABLATION_COLUMNS, a["knobs"], ablation_mark,
        title=f"ablation{where}: each knob against the baseline" + (f" ({a['root']})" if a["root"] else ""),
        caption=ablation_method(a) + (f" · peak memory: {a['peak_mem_source']}" if a.get("peak_mem_source") else ""),
    )


def notes(report: Report) -> list[str]:
    """Lines printed under the table: why jobs failed, ablation notes."""
    lines = [f"{r.job}: {r.status}: {r.reason}" for r in report.rows if r.status != "completed" and r.reason]
    for a in report.ablations:
        where = f" ({a['root']})" if a["root"] else ""
        lines += [f"ablation{where}: {n}" for n in a["notes"]]
    return lines


def print_report(report: Report, console: Console | None = None) -> None:
    tables = [table(report)] + [ablation_table(a) for a in shown_ablations(report)]
    console = console or wide_console(tables)
    for t in tables:
        console.print(t)
    for line in notes(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_text(report: Report, width: int) -> str:
    """The printed report as plain text at ``width`` columns (tests compare the two paths)."""
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False, force_terminal=False)
    print_report(report, console)
    return console.file.getvalue()  # type: ignore[attr-defined]


HTML_HEAD = (
    "<!doctype html><html><head><meta charset='utf-8'><title>perfrun report</title><style>\n"
    "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}.l{text-align:left}"
    "tr.best{background:#e6ffe6;font-weight:bold}tr.bad{color:#b00}caption{caption-side:bottom;text-align:left;"
    "color:#555;font-size:90%}\n"
    "</style></head><body><h1>perfrun report</h1>"
)


def to_html(report: Report, png: bytes | None) -> str:
    """A static page: the table, the ablation table and the plot, with nothing to fetch."""
    parts = [HTML_HEAD, html_table(run_columns(report), report.rows, run_mark, BEST_CAPTION)]
    for a in shown_ablations(report):
        where = f" on {a['device_name']}" if a.get("device_name") else ""
        parts += [f"<h2>Ablation{html.escape(where)}</h2>",
                  html_table(ABLATION_COLUMNS, a["knobs"], ablation_mark, ablation_method(a))]
    extra = notes(report)
    if extra:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in extra) + "</ul>")
    if png is not None:
        parts.append("<img alt='tokens/s against each swept key' src='data:image/png;base64,"
                     + base64.b64encode(png).decode() + "'>")
    else:
        parts.append(f"<p>No plot: matplotlib is not installed ({html.escape(PLOT_HINT)}).</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def common_overrides(report: Report) -> list[str]:
    """Overrides every job was given (what the table's per-row column leaves out)."""
    if not report.rows:
        return []
    first = report.rows[0].overrides
    return [o for o in first if all(o in r.overrides for r in report.rows[1:])]


def machine(rows: Sequence[Row]) -> str:
    """The devices (and software) the rows ran on, as a phrase."""
    named = dict.fromkeys(f"{r.device_name}" + (f" ({r.software})" if r.software else "")
                          for r in rows if r.device_name)
    return ", ".join(named) or "an unrecorded machine"


def to_markdown(report: Report) -> str:
    """GitHub Markdown: the runs table, then each ablation with its machine and method named."""
    out = [f"Runs on {machine(report.rows)}."]
    common = common_overrides(report)
    if common and report.swept_keys:
        out.append(f"Every job: `{' '.join(common)}`.")
    out += ["", *markdown_table(run_columns(report), report.rows), "", BEST_CAPTION + "."]
    for a in shown_ablations(report):
        where = (a.get("device_name") or "an unrecorded machine") + (f" ({a['software']})" if a.get("software") else "")
        out += ["", f"Ablation on {where}" + (f" ({a['root']})" if a["root"] else "") + ":", "",
                *markdown_table(ABLATION_COLUMNS, a["knobs"]), "",
                ablation_method(a) + (f"; peak memory: {a['peak_mem_source']}" if a.get("peak_mem_source") else "") + "."]
    notes_ = notes(report)
    if notes_:
        out += [""] + [f"- {n}" for n in notes_]
    return "\n".join(out) + "\n"
