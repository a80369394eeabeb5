"""The files a sweep leaves in its folder when it ends (written by the Hydra callback,
:class:`perfrun.ladder.callback.SweepSummary`): CSV, JSON and PNG, from the same reading and
renderers as ``perfrun report``, so the report of a sweep dir reproduces them byte for byte."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from perfrun.checkpoint.atomic import atomic_write
from perfrun.ladder.analysis import read_sweep
from perfrun.ladder.memory_plot import MEMORY_PNG, memory_png
from perfrun.ladder.plot import report_figure
from perfrun.report.plot import plot_or_warn
from perfrun.report.render import print_report, to_csv, to_json
from perfrun.report.rows import Report

SWEEP_CSV = "sweep_summary.csv"
SWEEP_JSON = "sweep_summary.json"
SWEEP_PNG = "sweep_summary.png"


def write_sweep_summary(sweep_dir: Path, console: Console | None = None) -> Report:
    """What the sweep callback does: CSV, JSON and PNG in ``sweep_dir``, and the printed table."""
    report = read_sweep([sweep_dir])
    atomic_write(sweep_dir / SWEEP_CSV, to_csv(report))
    atomic_write(sweep_dir / SWEEP_JSON, to_json(report))
    png = plot_or_warn(report, report_figure)
    if png is not None:
        atomic_write(sweep_dir / SWEEP_PNG, png)
    memory = [p for p in map(memory_png, report.ladders) if p is not None][:1]  # the first ladder's
    if memory:
        atomic_write(sweep_dir / MEMORY_PNG, memory[0])
    print_report(report, console)
    written = [SWEEP_CSV, SWEEP_JSON] + ([SWEEP_PNG] if png is not None else []) + ([MEMORY_PNG] if memory else [])
    (console or Console(highlight=False, soft_wrap=True)).print(
        f"sweep summary: {', '.join(str(sweep_dir / n) for n in written)}", markup=False, highlight=False)
    return report
