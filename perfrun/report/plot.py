"""The plot: tokens/s against each swept key, one panel per key, the best starred.

matplotlib is a base dependency (the ``perfrun[plot]`` extra is kept so that old install lines
still work); an environment without it gets one warning and no plot. Its object API with the
Agg canvas is used, not pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from perfrun.console import warn
from perfrun.report.rows import Report, Row, finite

PLOT_HINT = 'pip install "perfrun[plot]"'


def _number(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def _sort_values(values: Iterable[str | None]) -> list[str | None]:
    """Distinct values; in numeric order when they are all numbers, else as they came."""
    vals = list(dict.fromkeys(values))
    if all(_number(v) is not None for v in vals):
        return sorted(vals, key=_number)  # type: ignore[arg-type,return-value]
    return vals


def plot_png(report: Report) -> bytes | None:
    """PNG of tokens/s against each swept key (one panel per key), or of the ladder where the
    jobs are one (:mod:`perfrun.report.ladder_plot`); None without matplotlib."""
    from perfrun.report.ladder_plot import ladder_png

    try:
        return ladder_png(report, report.ladders[0]) if report.ladders else _draw(report)
    except ImportError:
        return None


def no_plot_warning() -> None:
    warn(f"matplotlib is not installed, so no plot was drawn; {PLOT_HINT} for the plot")


def plot_or_warn(report: Report) -> bytes | None:
    """The plot, or one warning line saying why there is none; never an exception."""
    try:
        png = plot_png(report)
    except Exception as e:  # noqa: BLE001 - a plot is never worth losing the table and files
        warn(f"no plot ({type(e).__name__}: {e}); the table and files are complete")
        return None
    if png is None:
        no_plot_warning()
    return png


def _bars_of_jobs(ax: Any, done: list[Row]) -> None:
    """No swept key: one bar per job."""
    ax.bar(range(len(done)), [r.tokens_per_s for r in done],
           color=["tab:green" if r.best else "tab:blue" for r in done])
    ax.set_xticks(range(len(done)), labels=[r.job for r in done], rotation=30, ha="right", fontsize=8)


def _panel(ax: Any, key: str, keys: list[str], report: Report, done: list[Row]) -> None:
    """tokens/s against ``key``: one line (or bars) per combination of the other keys."""
    values = _sort_values(r.swept.get(key) for r in report.rows)
    pos = {v: i for i, v in enumerate(values)}
    others = [k for k in keys if k != key]
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in done:
        groups.setdefault(tuple(r.swept.get(k) for k in others), []).append(r)
    numeric = all(_number(v) is not None for v in values)
    for combo, members in groups.items():
        members.sort(key=lambda r: pos[r.swept.get(key)])
        label = ", ".join(f"{k}={v}" for k, v in zip(others, combo, strict=True)) or None
        xs, ys = [pos[r.swept.get(key)] for r in members], [r.tokens_per_s for r in members]
        if not numeric and len(groups) == 1:  # named choices (knobs): bars, no line between them
            ax.bar(xs, ys, color=["tab:green" if r.best else "tab:blue" for r in members])
        else:  # a line only where the axis is a quantity
            ax.plot(xs, ys, marker="o", linestyle="-" if numeric else "none", label=label)
    for r in done:
        if r.best:
            ax.plot([pos[r.swept.get(key)]], [r.tokens_per_s], marker="*", markersize=16,
                    color="gold", markeredgecolor="black", linestyle="none", zorder=5)
    ax.set_xticks(range(len(values)), labels=["—" if v is None else str(v) for v in values],
                  fontsize=8, rotation=30 if len(values) > 6 else 0)
    if others and len(groups) > 1:
        ax.legend(fontsize=7)


def _draw(report: Report) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in report.rows if r.status == "completed" and finite(r.tokens_per_s)]
    keys = report.swept_keys or ["job"]
    fig = Figure(figsize=(max(5.0, 4.6 * len(keys)), 3.8), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    failed = len(report.rows) - len(done)
    for ax, key in zip(axes, keys, strict=True):
        if key == "job":
            _bars_of_jobs(ax, done)
        else:
            _panel(ax, key, keys, report, done)
        ax.set_xlabel(key)
        ax.set_ylabel("tokens/s (median of steady steps)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("tokens/s" + (f" ({failed} job(s) without a figure: failed or unfinished)" if failed else ""),
                 fontsize=10)
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()
