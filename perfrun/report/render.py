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
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text  # cells from files are shown as written, never read as rich markup

from perfrun.checkpoint.atomic import json_safe
from perfrun.console import wide_console
from perfrun.report.columns import (
    ALTERNATIVE_COLUMNS,
    GROUP_COLUMNS,
    LADDER_COLUMNS,
    LEAVE_ONE_OUT_COLUMNS,
    TRADEOFF_COLUMNS,
    Column,
    group_mark,
    run_columns,
    run_mark,
    rung_mark,
    shown,
)
from perfrun.report.plot import PLOT_HINT
from perfrun.report.rows import Report, Row
from perfrun.report.spoken import TRAINER_NAMES, as_hint
from perfrun.report.spoken import where as translated_dir

Mark = Callable[[Any], "str | None"]
RICH_STYLES = {"best": "bold green", "bad": "red", "flagged": "bold red"}
HTML_CLASSES = {"best": "best", "bad": "bad", "flagged": "bad"}
BEST_CAPTION = "★ best tokens/s (median of steady steps), where it beats the rest outside their spread"
REPEATS_CAPTION = ("median and ±half the min-max range of each configuration's repeats (contended jobs left out); "
                   "an effect whose ranges overlap the best's is no measurable effect")


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


def fitted_table(console: Console, columns: Sequence[Column], rows: Sequence[Any], mark: Mark,
                 title: str, caption: str) -> Table:
    """:func:`rich_table` as wide as ``console``: where a figure would be cut to an ellipsis,
    the columns of lowest ``keep`` are left out (the caption names them) rather than every
    cell shrunk; the HTML, Markdown and CSV keep them all."""
    kept = shown(columns, rows, tables=True)
    dropped: list[Column] = []
    while True:
        note = (f" · left out at {console.width} columns: {', '.join(c.header for c in dropped)} (a wider "
                "terminal, --markdown, --html or --csv show them)") if dropped else ""
        table = rich_table(kept, rows, mark, title=title, caption=caption + note)
        droppable = [c for c in kept if c.keep < 9]
        if not droppable or not _cuts(table, console.width):
            return table
        lowest = min(c.keep for c in droppable)
        gone = [c for c in droppable if c.keep == lowest][-1]
        kept, dropped = [c for c in kept if c is not gone], [*dropped, gone]


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
    """The machine-readable report: rows, repeats grouped, and each ladder's parts (``ladder``,
    ``leave_one_out``, ``tradeoffs``, ``recommended`` and the rest)."""
    out: dict[str, Any] = {
        "swept_keys": report.swept_keys,
        "best": report.best,
        "rows": [asdict(r) for r in report.rows],
        "repeats": [asdict(g) for g in report.groups if len(g.jobs) > 1],
        "ablation": report.ladders,
    }
    if len(report.ladders) == 1:  # one ladder: its parts at the top level too
        out.update({k: report.ladders[0][k] for k in ("ladder", "leave_one_out", "tradeoffs", "recommended")})
    return out


def to_json(report: Report) -> str:
    return json.dumps(json_safe(to_dict(report)), indent=2, default=str) + "\n"


@dataclass
class Section:
    """One table of the report, the same in every medium."""

    title: str
    columns: Sequence[Column]
    rows: Sequence[Any]
    mark: Mark
    caption: str


def _where(a: dict[str, Any]) -> str:
    return (f" on {a['device_name']}" if a.get("device_name") else "") + (f" ({a['root']})" if a["root"] else "")


def sections(report: Report) -> list[Section]:
    """The runs table, the repeats table where jobs were repeated, and each ladder's tables."""
    mem_sources = sorted({r.peak_mem_source for r in report.rows if r.peak_mem_source})
    out = [Section("perfrun: runs", run_columns(report), report.rows, run_mark,
                   BEST_CAPTION + (f" · peak memory: {', '.join(mem_sources)}" if mem_sources else ""))]
    repeated = [g for g in report.groups if len(g.jobs) > 1]
    if repeated and not report.ladders:  # a ladder's tables group its repeats themselves
        out.append(Section("repeats of the same overrides", GROUP_COLUMNS, report.groups, group_mark, REPEATS_CAPTION))
    for a in report.ladders:
        where = _where(a)
        caption = a["loss_rule"] + (f" · peak memory: {a['peak_mem_source']}" if a.get("peak_mem_source") else "")
        out.append(Section(f"ladder{where}: each rung adds one knob to the rung below", LADDER_COLUMNS, a["ladder"],
                           rung_mark, caption))
        if a["alternatives"]:
            out.append(Section(f"alternatives{where}: in place of a rung", ALTERNATIVE_COLUMNS, a["alternatives"],
                               rung_mark, caption))
        if a["leave_one_out"]:
            out.append(Section(f"leave-one-out{where}: the top rung ({a['top']}) without each knob",
                               LEAVE_ONE_OUT_COLUMNS, a["leave_one_out"], rung_mark, caption))
        if a["tradeoffs"]:
            out.append(Section(f"memory trade-offs{where}: the top rung with each setting, apart from speed",
                               TRADEOFF_COLUMNS, a["tradeoffs"], lambda t: None,
                               "largest batch: dataloader.batch_size=auto (on a CPU within its tensor budget)"
                               + "".join(f" · {t['memory_verdict']}" for t in a["tradeoffs"] if t.get("memory_verdict"))))
    return out


def header(report: Report) -> list[str]:
    """What the report is of: the machine, the software, when, the command and the folder."""
    import datetime

    rows = report.rows
    env = {k: v for r in rows for k, v in (("machine", r.device_name), ("software", r.software)) if v}
    stamps = [p.joinpath("summary.json").stat().st_mtime for p in report.paths.values() if (p / "summary.json").is_file()]
    when = datetime.datetime.fromtimestamp(max(stamps), tz=datetime.UTC).strftime("%Y-%m-%d %H:%M UTC") if stamps else None
    common = common_overrides(report)
    swept = []
    for k in (k for k in report.swept_keys if k != "source"):
        plus = "+" if any(o.startswith(f"+{k}=") for r in rows for o in r.overrides) else ""
        swept.append(f"{plus}{k}=" + ",".join(dict.fromkeys(str(r.swept.get(k)) for r in rows)))
    folders = os.path.commonpath([str(p) for p in report.paths.values()]) if report.paths else "?"
    lines = [f"machine: {env.get('machine', 'not recorded')} ({env.get('software', 'versions not recorded')})"]
    lines += [f"finished: {when}"] if when else []
    lines += [f"command: perfrun train {'-m ' if len(rows) > 1 else ''}{' '.join([*common, *swept])}".rstrip()]
    lines += [f"from: {folders}"]
    lines += [model_line(a["model"]) for a in report.ladders if a.get("model")]
    return lines


def model_line(m: dict[str, Any]) -> str:
    """Which model a ladder measured: its name, size, and FLOPs per token with their source."""
    name = m["name"] + (f" ({m['target']})" if m.get("target") else "")
    if m.get("path"):  # model=hf: the architecture transformers built, and its folder
        name += f" ({str(m.get('class') or '?').rsplit('.', 1)[-1]} from {m['path']})"
    params = f"{m['params'] / 1e6:,.2f}M parameters" if m.get("params") else "parameters not recorded"
    flops = (f"{m['flops_per_token'] / 1e6:,.2f}M FLOPs per token ({m['flops_per_token_source']})"
             if m.get("flops_per_token") else "FLOPs per token not recorded")
    return f"model: {name}, {params}, {flops}"


def notes(report: Report) -> list[str]:
    """Lines printed under the tables: why jobs failed, which shared the machine, ladder notes
    and each ladder's verdict, the line to paste."""
    lines = [f"{r.job}: {r.status}: {r.reason}" for r in report.rows
             if r.status not in ("completed", "skipped") and r.reason]  # skipped rungs: the ladder says why
    lines += [f"{r.job}: contended, never ranked: {'; '.join(r.contention)}" for r in report.rows
              if r.contended and not r.ablation.get("rung")]
    unknown = [r.job for r in report.rows if r.machine_unknown and not r.ablation.get("rung")]
    lines += [f"{len(unknown)} job(s) have no contention figures in summary.json, so whether they had the machine is "
              f"unknown: never ranked ({', '.join(unknown)})"] if unknown else []
    for a in report.ladders:
        where = f" ({a['root']})" if a["root"] else ""
        lines += [f"ladder{where}: {n}" for n in a["notes"]]
        lines.append(a["verdict"])
        if "measured_as" in a["recommended"]:
            lines.append(as_hint(a["root"] or translated_dir(report)))
    if not report.ladders and len(report.rows) == 1 and report.rows[0].status == "completed":
        lines.append(as_hint(translated_dir(report), run=True))
    return lines


def _cuts(table: Table, width: int) -> bool:
    """Whether rich, at ``width`` columns, would cut a cell of ``table`` to an ellipsis (its
    own measure cannot tell: it shrinks the widest columns first, below their longest word)."""
    probe = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    probe.print(table)
    return "…" in probe.file.getvalue()  # type: ignore[attr-defined]


def print_report(report: Report, console: Console | None = None) -> None:
    parts = sections(report)
    if console is None:
        console = wide_console([rich_table(s.columns, s.rows, s.mark, title=s.title, caption=s.caption) for s in parts])
    tables = [fitted_table(console, s.columns, s.rows, s.mark, s.title, s.caption) for s in parts]
    for line in header(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
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
    "color:#555;font-size:90%}.head{color:#333;font-family:monospace}img{max-width:100%}"
    "pre{background:#f6f6f6;padding:8px;overflow-x:auto}summary{cursor:pointer;margin:4px 0}\n"
    "</style></head><body><h1>perfrun report</h1>"
)


def to_html(report: Report, png: bytes | None) -> str:
    """A static page: the tables and the plot, with nothing to fetch."""
    parts = [HTML_HEAD, "<p class='head'>" + "<br>".join(html.escape(h) for h in header(report)) + "</p>"]
    for i, sec in enumerate(sections(report)):
        if i:
            parts.append(f"<h2>{html.escape(sec.title)}</h2>")
        parts.append(html_table(sec.columns, sec.rows, sec.mark, sec.caption))
    extra = notes(report)
    if extra:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in extra) + "</ul>")
    parts += _translations_html(report)
    if png is not None:
        parts.append("<img alt='tokens/s against each swept key' src='data:image/png;base64,"
                     + base64.b64encode(png).decode() + "'>")
    else:
        parts.append(f"<p>No plot: matplotlib is not installed ({html.escape(PLOT_HINT)}).</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _translations_html(report: Report) -> list[str]:
    """Each verdict (or the single run) as code for Hugging Face's Trainer, Lightning and a
    plain PyTorch loop, one collapsible block each (perfrun report DIR --as TRAINER prints them)."""
    out = []
    for s in report.spoken:
        out.append(f"<h2>In your trainer's words: {html.escape(s.title)}</h2>")
        if s.why_not:
            out.append(f"<p>No translation: {html.escape(s.why_not)}</p>")
        for trainer, text in s.texts.items():
            out.append(f"<details><summary>{html.escape(TRAINER_NAMES[trainer])} (--as {trainer})</summary>"
                       f"<pre><code>{html.escape(text)}</code></pre></details>")
    return out



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
    """GitHub Markdown: the runs table, then the other tables with their machine and method named."""
    out = [f"Runs on {machine(report.rows)}.", "", *(f"- {h}" for h in header(report)), ""]
    common = common_overrides(report)
    if common and report.swept_keys:
        out.append(f"Every job: `{' '.join(common)}`.")
    for i, sec in enumerate(sections(report)):
        out += ["", *( [f"{sec.title[0].upper()}{sec.title[1:]}:", ""] if i else []),
                *markdown_table(sec.columns, sec.rows), "", sec.caption + "."]
    notes_ = notes(report)
    if notes_:
        out += [""] + [f"- {n}" for n in notes_]
    return "\n".join(out) + "\n"
