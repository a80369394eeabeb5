"""The ladder's figure (one PNG, for the HTML page and ``sweep_summary.png``): the ladder as
a waterfall of tokens/s with each rung's min-max range as an error bar; the leave-one-out
bars; memory against tokens/s for the trade-offs; each job's loss and tokens/s over the
steps (a contended job shows as a dashed line); and the step breakdown as stacked bars.

matplotlib's object API with the Agg canvas, as :mod:`perfrun.report.plot`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from perfrun.report.metrics_file import train_records
from perfrun.report.rows import Report, finite

PHASES = ("data", "forward", "backward", "optimizer")


def _curves(job: Path) -> tuple[list[int], list[float], list[float]]:
    """steps, loss and tokens/s of the train records of ``job``'s metrics.jsonl (rows a
    resume trained again dropped)."""
    rows = [r for r in train_records(job) if finite(r.get("loss")) and finite(r.get("tokens_per_s"))]
    return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], [float(r["tokens_per_s"]) for r in rows]


def _error(e: dict[str, Any]) -> list[float]:
    lo, hi, med = e.get("tokens_per_s_min"), e.get("tokens_per_s_max"), e.get("tokens_per_s")
    return [med - lo, hi - med] if finite(lo) and finite(hi) and finite(med) else [0.0, 0.0]


def _waterfall(ax: Any, a: dict[str, Any]) -> None:
    """Each measured rung's bar starts where the rung below ended: the step is the knob's gain."""
    rungs = [e for e in a["ladder"] if e["applicable"] and finite(e["tokens_per_s"])]
    below = 0.0
    for i, e in enumerate(rungs):
        gain = e["tokens_per_s"] - below
        colour = "tab:gray" if i == 0 else "tab:olive" if not e["vs_below_measurable"] else \
            "tab:green" if gain > 0 else "tab:red"
        ax.bar(i, gain, bottom=below, color=colour, yerr=[[x] for x in _error(e)], capsize=4)
        below = e["tokens_per_s"]
    ax.set_xticks(range(len(rungs)), labels=[e["rung"] for e in rungs], rotation=30, ha="right", fontsize=8)
    skipped = [e["rung"] for e in a["ladder"] if not e["applicable"] or not finite(e["tokens_per_s"])]
    ax.set_title("ladder: tokens/s, each rung on the one below (olive: no measurable effect)" + (f"\n(not shown: {', '.join(skipped)})" if skipped
                                                                     else ""), fontsize=9)
    ax.set_ylabel("tokens/s (median, min-max bars)")


def _leave_one_out(ax: Any, a: dict[str, Any]) -> None:
    rows = [e for e in a["leave_one_out"] if finite(e["vs_below"])]
    ax.barh(range(len(rows)), [e["vs_below"] for e in rows],
            color=["tab:red" if e["vs_below_measurable"] else "tab:gray" for e in rows])
    if rows:
        ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels=[f"without {e['knob']}" for e in rows], fontsize=8)
    ax.set_title(f"leave-one-out: tokens/s against the top ({a['top']})\n(grey: no measurable effect)", fontsize=9)


def _tradeoffs(ax: Any, a: dict[str, Any]) -> None:
    for t in a["tradeoffs"]:
        if finite(t.get("peak_mem_mib")) and finite(t.get("tokens_per_s")):
            ax.plot(t["peak_mem_mib"], t["tokens_per_s"], marker="o", linestyle="none")
            ax.annotate(t["setting"], (t["peak_mem_mib"], t["tokens_per_s"]), fontsize=7)
    ax.set_xlabel("peak memory MiB")
    ax.set_ylabel("tokens/s")
    ax.set_title("memory trade-offs (top rung)", fontsize=9)


def _over_steps(ax_loss: Any, ax_tps: Any, report: Report, a: dict[str, Any]) -> None:
    for r in report.rows:
        if r.root != a["root"] or not r.ablation.get("rung"):
            continue
        steps, loss, tps = _curves(report.paths[r.job])
        style = "--" if r.contended else "-"
        ax_loss.plot(steps, loss, linestyle=style, linewidth=0.8, label=f"{r.job} {r.ablation['rung']}")
        ax_tps.plot(steps, tps, linestyle=style, linewidth=0.8)
    ax_loss.set_title("train loss per job", fontsize=9)
    ax_tps.set_title("tokens/s per job over the steps (dashed: contended)", fontsize=9)
    ax_loss.set_xlabel("step")
    ax_tps.set_xlabel("step")
    if len(ax_loss.lines) <= 12:
        ax_loss.legend(fontsize=6)


def _breakdown(ax: Any, report: Report, a: dict[str, Any]) -> None:
    from perfrun.summary import read_summary

    labels, shares = [], []
    for e in a["ladder"] + a["leave_one_out"]:
        if not e["applicable"] or not e["jobs"]:
            continue
        try:
            share = (read_summary(report.paths[e["jobs"][0]]).get("step_breakdown") or {}).get("share_pct") or {}
        except (OSError, ValueError):
            continue
        if share:
            labels.append(e["rung"])
            shares.append([float(share.get(p) or 0.0) for p in PHASES])
    bottom = [0.0] * len(labels)
    for i, phase in enumerate(PHASES):
        values = [s[i] for s in shares]
        ax.bar(range(len(labels)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(labels)), labels=labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of the step")
    ax.set_title("step breakdown (median per phase)", fontsize=9)
    if labels:
        ax.legend(fontsize=7)


def _empty(ax: Any) -> None:
    """Say so where a panel has nothing to draw, rather than leave blank axes."""
    if not ax.lines and not ax.patches:
        ax.text(0.5, 0.5, "no figures recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])


def ladder_png(report: Report, a: dict[str, Any]) -> bytes:
    """The figure of one ladder (raises ImportError without matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 9), layout="constrained")
    axes = fig.subplots(2, 3)
    _waterfall(axes[0][0], a)
    _leave_one_out(axes[0][1], a)
    _tradeoffs(axes[0][2], a)
    _over_steps(axes[1][0], axes[1][1], report, a)
    _breakdown(axes[1][2], report, a)
    for ax in axes.flat:
        _empty(ax)
    where = f" on {a['device_name']}" if a.get("device_name") else ""
    fig.suptitle(f"perfrun ladder{where}" + (f" ({a['root']})" if a["root"] else ""), fontsize=11)
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()
