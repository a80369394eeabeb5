"""The ladder's figure (one PNG, for the HTML page and ``sweep_summary.png``): the ladder as
a waterfall of tokens/s with each rung's min-max range as an error bar (a rung of one run
says "1 run"; its contended, outlier and failed jobs are hollow markers at its place, never
part of a bar); the leave-one-out bars with their noise; memory against tokens/s for the
trade-offs; each job's loss and tokens/s over the steps (a job not counted shows dashed and
labelled); the step breakdown as stacked bars; the verdict and the count of jobs that shared
the machine on the image itself.

matplotlib's object API with the Agg canvas, as :mod:`perfrun.report.plot`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perfrun.report.figures import contended_line, draw_apart, wrap
from perfrun.report.metrics_file import train_records
from perfrun.report.plot import figure
from perfrun.report.rows import Report, finite

PHASES = ("data", "forward", "backward", "optimizer")


def _curves(job: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, loss) and (step, tokens/s) of the train records of ``job``'s metrics.jsonl (rows
    a resume trained again dropped)."""
    rows = train_records(job)
    return ([(int(r["step"]), float(r["loss"])) for r in rows if finite(r.get("loss"))],
            [(int(r["step"]), float(r["tokens_per_s"])) for r in rows if finite(r.get("tokens_per_s"))])


def _error(e: dict[str, Any]) -> list[float]:
    lo, hi, med = e.get("tokens_per_s_min"), e.get("tokens_per_s_max"), e.get("tokens_per_s")
    return [med - lo, hi - med] if finite(lo) and finite(hi) and finite(med) else [0.0, 0.0]


def _colour(first: bool, measurable: bool | None, gain: float) -> str:
    """grey: the first bar; green/red: an effect outside the noise; olive: inside it; light
    blue: unknown (a single run and no measured noise of the machine)."""
    if first:
        return "tab:gray"
    return {True: "tab:green" if gain > 0 else "tab:red", False: "tab:olive"}.get(measurable, "lightsteelblue")  # type: ignore[arg-type]


def _one_run(ax: Any, x: float, y: float, **kw: Any) -> None:
    ax.annotate("1 run", (x, y), xytext=kw.pop("xytext", (0, 3)), textcoords="offset points", fontsize=7,
                ha=kw.pop("ha", "center"), **kw)


def _jobs_apart(report: Report, a: dict[str, Any], x_of: dict[str, float]) -> dict[str, list[tuple[float, float, str]]]:
    """The ladder's jobs that do not stand (contended, unknown, outlier, failed) at their rung's place."""
    outliers = {o["job"] for o in a.get("outliers", [])}
    out: dict[str, list[tuple[float, float, str]]] = {"contended": [], "unknown": [], "outlier": [], "failed": []}
    for r in report.rows:
        rung = r.ablation.get("rung")
        if r.root != a["root"] or rung not in x_of or r.status == "skipped":
            continue
        y = r.tokens_per_s if finite(r.tokens_per_s) else 0.0
        if r.status != "completed":
            out["failed"].append((x_of[rung], y, f"{r.job}: {r.status}"))
        elif r.contended:
            out["contended"].append((x_of[rung], y, f"{r.job}: contended"))
        elif r.machine_unknown:
            out["unknown"].append((x_of[rung], y, f"{r.job}: machine unknown"))
        elif r.job in outliers:
            out["outlier"].append((x_of[rung], y, f"{r.job}: outlier"))
    return out


def _waterfall(ax: Any, report: Report, a: dict[str, Any]) -> None:
    """Each measured rung's bar starts where the rung below ended: the step is the knob's gain;
    a rung's jobs that do not stand are hollow markers at its place."""
    rungs = [e for e in a["ladder"] if e["applicable"]]
    below, first = 0.0, True
    for i, e in enumerate(rungs):
        if not finite(e["tokens_per_s"]):
            continue
        gain = e["tokens_per_s"] - below
        ax.bar(i, gain, bottom=below, color=_colour(first, e["vs_below_measurable"], gain),
               yerr=[[x] for x in _error(e)], capsize=4)
        if e["n"] == 1:
            _one_run(ax, i, e["tokens_per_s"])
        below, first = e["tokens_per_s"], False
    draw_apart(ax, _jobs_apart(report, a, {e["rung"]: i for i, e in enumerate(rungs)}))
    ax.set_xticks(range(len(rungs)), labels=[e["rung"] for e in rungs], rotation=30, ha="right", fontsize=8)
    skipped = [e["rung"] for e in a["ladder"] if not e["applicable"]]
    ax.set_title("ladder: tokens/s, each rung on the one below\n(green/red: outside the noise; olive: inside it; "
                 "light blue: 1 run, effect unknown)" + (f"\nnot applicable here: {', '.join(skipped)}" if skipped else ""),
                 fontsize=8)
    ax.set_ylabel("tokens/s (median, min-max bars)")
    ax.set_ylim(bottom=0)


def _leave_one_out(ax: Any, a: dict[str, Any]) -> None:
    rows = [e for e in a["leave_one_out"] if finite(e["vs_below"])]
    ratios = [e["vs_below"] for e in rows]
    err = [r * e["vs_below_noise_pct"] / 100 if finite(e["vs_below_noise_pct"]) else 0.0 for r, e in zip(ratios, rows, strict=True)]
    ax.barh(range(len(rows)), ratios, xerr=err, capsize=3,
            color=[_colour(False, e["vs_below_measurable"], e["vs_below"] - 1) for e in rows])
    for i, e in enumerate(rows):
        if e["n"] == 1 or e["vs_below_single"]:
            _one_run(ax, e["vs_below"], i, xytext=(4, -3), ha="left")
    if rows:
        ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels=[f"without {e['knob']}" for e in rows], fontsize=8)
    said = {"green/red: outside the noise": any(e["vs_below_measurable"] for e in rows),
            "olive: no measurable effect": any(e["vs_below_measurable"] is False and not e["vs_below_single"] for e in rows),
            "olive: inside the machine's noise (1 run)": any(e["vs_below_measurable"] is False and e["vs_below_single"]
                                                              for e in rows),
            "light blue: 1 run, effect unknown": any(e["vs_below_measurable"] is None for e in rows)}
    unranked = [e["rung"] for e in a["leave_one_out"] if e["applicable"] and not finite(e["vs_below"])]
    legend = "; ".join(k for k, v in said.items() if v)
    ax.set_title(f"leave-one-out: tokens/s against the top ({a['top']})" + (f"\n({legend})" if legend else "")
                 + (f"\nnot ranked: {', '.join(unranked)}" if unranked else ""), fontsize=8)


def _tradeoffs(ax: Any, a: dict[str, Any]) -> None:
    points = [t for t in a["tradeoffs"] if finite(t.get("peak_mem_mib")) and finite(t.get("tokens_per_s"))]
    middle = (min(t["peak_mem_mib"] for t in points) + max(t["peak_mem_mib"] for t in points)) / 2 if points else 0
    for t in points:
        ax.plot(t["peak_mem_mib"], t["tokens_per_s"], marker="o", linestyle="none")
        right = t["peak_mem_mib"] > middle  # a label on the right half reads leftward: it stays inside the axes
        ax.annotate(t["setting"], (t["peak_mem_mib"], t["tokens_per_s"]), fontsize=7, textcoords="offset points",
                    xytext=(-4 if right else 4, 3), ha="right" if right else "left")
    ax.set_xlabel("peak memory MiB")
    ax.set_ylabel("tokens/s")
    ax.set_title("memory trade-offs (top rung)", fontsize=9)


def _over_steps(ax_loss: Any, ax_tps: Any, report: Report, a: dict[str, Any]) -> None:
    outliers = {o["job"] for o in a.get("outliers", [])}
    for r in report.rows:
        if r.root != a["root"] or not r.ablation.get("rung"):
            continue
        loss, tps = _curves(report.paths[r.job])
        apart = "contended" if r.contended else "machine unknown" if r.machine_unknown else \
            "outlier" if r.job in outliers else ""
        style = "--" if apart else "-"
        label = f"{r.job} {r.ablation['rung']}" + (f" ({apart})" if apart else "")
        for ax, pts in ((ax_loss, loss), (ax_tps, tps)):
            if pts:
                ax.plot([p for p, _ in pts], [v for _, v in pts], linestyle=style, linewidth=0.8, label=label,
                        marker="o" if len(pts) < 3 else None, markersize=3)  # a short (budgeted) job: its points
    ax_loss.set_title("train loss per job", fontsize=9)
    ax_tps.set_title("tokens/s per job over the steps (dashed: contended or outlier, not counted)", fontsize=9)
    ax_loss.set_xlabel("step")
    ax_tps.set_xlabel("step")
    if 0 < len(ax_loss.lines) <= 12:
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


def ladder_figure(report: Report, a: dict[str, Any]) -> Any:
    """The figure of one ladder (raises ImportError without matplotlib)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 9.5), layout="constrained")
    axes = fig.subplots(2, 3)
    _waterfall(axes[0][0], report, a)
    _leave_one_out(axes[0][1], a)
    _tradeoffs(axes[0][2], a)
    _over_steps(axes[1][0], axes[1][1], report, a)
    _breakdown(axes[1][2], report, a)
    for ax in axes.flat:
        _empty(ax)
    where = f" on {a['device_name']}" if a.get("device_name") else ""
    rows = [r for r in report.rows if r.root == a["root"] and r.ablation.get("rung")]
    fig.suptitle(f"perfrun ladder{where}" + (f" ({a['root']})" if a["root"] else "") + "\n" + contended_line(rows),
                 fontsize=11)
    fig.supxlabel(wrap(a["verdict"], fig.get_figwidth()), fontsize=9)
    return fig


def report_figure(report: Report) -> Any:
    """The figure of a report that may hold a ladder: a single run's own figure, the first
    ladder's where the jobs are one, else tokens/s against each swept key."""
    if len(report.rows) != 1 and report.ladders:
        return ladder_figure(report, report.ladders[0])
    return figure(report)
