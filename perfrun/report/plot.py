"""The plot: tokens/s against each swept key, one panel per key, the best starred.

Only what stands is drawn as a figure: the median of the jobs that completed with the
machine to themselves, with its min-max range (a bar of one run says "1 run"). A contended or
failed job is drawn apart, hollow and labelled, and never joined into a line. The image
carries the verdict and the count of jobs that shared the machine, so a forwarded PNG says
what the table says. The figure functions return matplotlib Figures (tests read their artists).

matplotlib is a base dependency (the ``perfrun[plot]`` extra is kept so that old install lines
still work); an environment without it gets one warning and no plot. Its object API with the
Agg canvas is used, not pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from perfrun.console import warn
from perfrun.report.figures import contended_line, draw_apart, png, standing, wrap
from perfrun.report.noise import Spread, effect, spread
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


def plot_png(report: Report, figure_of: Callable[[Report], Any] | None = None) -> bytes | None:
    """PNG of the report's figure (``figure_of``, by default :func:`figure`); None without matplotlib."""
    try:
        return png((figure_of or figure)(report))
    except ImportError:
        return None


def figure(report: Report) -> Any:
    """The figure of a report: a single run's loss and tokens/s over the steps
    (:mod:`~perfrun.report.run_plot`), else tokens/s against each swept key (a ladder's figure
    is :func:`perfrun.ladder.plot.report_figure`). Raises ImportError without matplotlib."""
    from perfrun.report.run_plot import run_figure

    if len(report.rows) == 1:  # a run (a ladder's job too): what it did over its steps
        return run_figure(report, report.rows[0])
    return sweep_figure(report)


def no_plot_warning() -> None:
    warn(f"matplotlib is not installed, so no plot was drawn; {PLOT_HINT} for the plot")


def plot_or_warn(report: Report, figure_of: Callable[[Report], Any] | None = None) -> bytes | None:
    """The plot, or one warning line saying why there is none; never an exception."""
    try:
        data = plot_png(report, figure_of)
    except Exception as e:  # noqa: BLE001 - a plot is never worth losing the table and files
        warn(f"no plot ({type(e).__name__}: {e}); the table and files are complete")
        return None
    if data is None:
        no_plot_warning()
    return data


def _apart_points(rows: list[Row], x_of: Any) -> dict[str, list[tuple[float, float, str]]]:
    """Where each job that does not stand goes: its tokens/s if it has one, else the axis."""
    out: dict[str, list[tuple[float, float, str]]] = {"contended": [], "unknown": [], "failed": []}
    for r in rows:
        if standing(r) or r.status == "skipped":
            continue
        y = r.tokens_per_s if finite(r.tokens_per_s) else 0.0
        if r.contended and r.status == "completed":
            out["contended"].append((x_of(r), y, f"{r.job}: contended"))
        elif r.machine_unknown:
            out["unknown"].append((x_of(r), y, f"{r.job}: machine unknown"))
        else:
            out["failed"].append((x_of(r), y, f"{r.job}: {r.status}"))
    return out


def _bar_spreads(ax: Any, xs: list[int], spreads: list[Spread], colours: list[str]) -> None:
    """Bars at the medians with their min-max range; a bar of one run says so."""
    meds = [s.median for s in spreads]
    err = [[s.median - s.lo for s in spreads], [s.hi - s.median for s in spreads]]  # type: ignore[operator]
    ax.bar(xs, meds, yerr=err, capsize=4, color=colours)
    for x, s in zip(xs, spreads, strict=True):
        if s.n == 1:
            ax.annotate("1 run", (x, 0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)


def _bars_of_jobs(ax: Any, report: Report) -> None:
    """No swept key: one bar per job that stands; the others hollow at their place."""
    rows = [r for r in report.rows if r.status != "skipped"]
    stand = [(i, r) for i, r in enumerate(rows) if standing(r)]
    if stand:
        _bar_spreads(ax, [i for i, _ in stand], [spread([r.tokens_per_s]) for _, r in stand],
                     ["tab:green" if r.best else "tab:blue" for _, r in stand])
    index = {r.job: i for i, r in enumerate(rows)}
    draw_apart(ax, _apart_points(rows, lambda r: index[r.job]))
    ax.set_xticks(range(len(rows)), labels=[r.job for r in rows], rotation=30, ha="right", fontsize=8)


def _panel(ax: Any, key: str, keys: list[str], report: Report) -> None:
    """tokens/s against ``key``: per combination of the other keys, the median of the jobs
    that stand at each value with their range; a line only where the axis is a quantity."""
    values = _sort_values(r.swept.get(key) for r in report.rows)
    pos = {v: i for i, v in enumerate(values)}
    others = [k for k in keys if k != key]
    groups: dict[tuple[Any, ...], dict[int, list[float]]] = {}
    for r in report.rows:
        if standing(r):
            at = groups.setdefault(tuple(r.swept.get(k) for k in others), {})
            at.setdefault(pos[r.swept.get(key)], []).append(r.tokens_per_s)  # type: ignore[arg-type]
    numeric = all(_number(v) is not None for v in values)
    for combo, at in groups.items():
        xs = sorted(at)
        spreads = [spread(at[x]) for x in xs]
        label = ", ".join(f"{k}={v}" for k, v in zip(others, combo, strict=True)) or None
        if not numeric and len(groups) == 1:  # named choices (knobs): bars, no line between them
            best = {pos[r.swept.get(key)] for r in report.rows if r.best}
            _bar_spreads(ax, xs, spreads, ["tab:green" if x in best else "tab:blue" for x in xs])
        else:
            ax.errorbar(xs, [s.median for s in spreads], yerr=[[s.median - s.lo for s in spreads],  # type: ignore[operator]
                        [s.hi - s.median for s in spreads]], marker="o", capsize=3,  # type: ignore[operator]
                        linestyle="-" if numeric else "none", label=label)
    for r in report.rows:
        if r.best:
            ax.plot([pos[r.swept.get(key)]], [r.tokens_per_s], marker="*", markersize=16,
                    color="gold", markeredgecolor="black", linestyle="none", zorder=5)
    draw_apart(ax, _apart_points(report.rows, lambda r: pos[r.swept.get(key)]))
    ax.set_xticks(range(len(values)), labels=["—" if v is None else str(v) for v in values],
                  fontsize=8, rotation=30 if len(values) > 6 else 0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def sweep_verdict(report: Report) -> str:
    """The sweep's one line: the configuration faster than every other outside the noise, or why none is."""
    stand = [g for g in report.groups if g.tps.median is not None]
    best = next((g for g in stand if g.best), None)
    if not stand:
        return "verdict: none: no job completed with the machine to itself"
    if best is None:
        return "verdict: no configuration is faster than the others outside the noise"
    runs = "1 run" if best.tps.n < 2 else f"{best.tps.n} runs, ±{best.tps.half_pct:.1f}%"
    what = f"verdict: {' '.join(best.overrides) or '(defaults)'}: {best.tps.median:,.0f} tokens/s ({runs})"
    if len(stand) == 1:
        return what + ", the only configuration measured with the machine to itself"
    if all(effect(best.tps, g.tps).measurable for g in stand if g is not best):
        return what + ", faster than every other outside the noise"
    return what + ", the fastest median (single runs: no spread to judge the others by; repeat=0,1,2 gives one)"


def sweep_figure(report: Report) -> Any:
    from matplotlib.figure import Figure

    keys = report.swept_keys or ["job"]
    fig = Figure(figsize=(max(6.0, 4.8 * len(keys)), 4.4), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    failed = sum(1 for r in report.rows if r.status not in ("completed", "skipped"))
    for ax, key in zip(axes, keys, strict=True):
        if key == "job":
            _bars_of_jobs(ax, report)
        else:
            _panel(ax, key, keys, report)
        ax.set_xlabel(key)
        ax.set_ylabel("tokens/s (median of steady steps)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    width = fig.get_figwidth()
    fig.suptitle(wrap("tokens/s: " + contended_line(report.rows)
                      + (f"; {failed} job(s) without a figure: failed or unfinished" if failed else ""), width, 10),
                 fontsize=10)
    fig.supxlabel(wrap(sweep_verdict(report), width), fontsize=9)
    return fig
