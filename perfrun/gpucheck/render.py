"""gpu-check's two outputs: the verdict as rich tables (a section per table, then what
to do), and the ``--json`` document (every fact, every check, the verdict)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from rich.markup import escape
from rich.table import Table

from perfrun.gpucheck.checks import cpu_precision
from perfrun.gpucheck.load import described
from perfrun.gpucheck.verdict import FAIL, OK, SKIP, WARN, Check, counts, exit_code

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render(report: dict[str, Any], checks: list[Check], console: Any) -> None:
    """The checks by section, the fixes of every warning and failure, and the verdict."""
    sections: dict[str, list[Check]] = {}
    for c in checks:
        sections.setdefault(c.section, []).append(c)
    for section, items in sections.items():
        table = Table(title=section, title_justify="left", show_header=False, expand=False, box=None, padding=(0, 1))
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for c in items:
            table.add_row(escape(c.name), f"[{_STYLE[c.status]}]{c.status}[/]", escape(c.detail))
        console.print(table)
        console.print()
    fixes = [c for c in checks if c.status in (WARN, FAIL)]
    if fixes:
        table = Table(title="what to do", title_justify="left", show_header=False, box=None, padding=(0, 1))
        table.add_column("status", no_wrap=True)
        table.add_column("check", no_wrap=True, style="bold")
        table.add_column("fix", overflow="fold")
        for c in fixes:
            table.add_row(f"[{_STYLE[c.status]}]{c.status}[/]", escape(f"{c.section}: {c.name}"), escape(c.fix or ""))
        console.print(table)
        console.print()
    busy = described(report.get("load") or [])
    if busy:
        console.print(f"[yellow]warning: busy[/]: {escape(busy)}; the measurements above are floors, not this machine's peak")
    n = counts(checks)
    verdict = "[bold red]FAIL[/]" if exit_code(checks) else "[bold green]PASS[/]"
    console.print(
        f"{verdict}: {n[OK]} ok, {n[WARN]} warning(s), {n[FAIL]} failure(s), {n[SKIP]} skipped "
        f"({report.get('gather_s', 0):.1f} s)"
    )


def add_verdict(report: dict[str, Any], checks: list[Check]) -> None:
    """Complete the facts into the ``--json`` document: the checks, their counts, the exit
    code and verdict, and on a CPU the precision to train in (``precision_advice``)."""
    report["checks"] = [asdict(c) for c in checks]
    report["summary"] = counts(checks)
    report["exit_code"] = exit_code(checks)
    report["verdict"] = "fail" if report["exit_code"] else "pass"
    advice = cpu_precision(report.get("measurements") or {})
    if advice is not None:
        report["precision_advice"] = advice


def to_json(report: dict[str, Any]) -> str:
    """The document as printed: indented, anything JSON lacks written as text."""
    return json.dumps(report, indent=2, default=str) + "\n"
