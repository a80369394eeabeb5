"""The figure of a single run (``perfrun report RUN_DIR``): its train and validation loss and
its tokens/s over the steps, from metrics.jsonl, with the warm-up the summary's median leaves
out shaded and that median drawn, so the two figures a user sees (per log interval, median
of the steady steps) stand side by side with their names.

matplotlib's object API with the Agg canvas, as :mod:`perfrun.report.plot`.
"""

from __future__ import annotations

from typing import Any

from perfrun.report.figures import wrap
from perfrun.report.metrics_file import train_records
from perfrun.report.rows import Report, Row, finite
from perfrun.summary import read_summary


def _summary(report: Report, row: Row) -> dict[str, Any]:
    try:
        return dict(read_summary(report.paths[row.job]))
    except (OSError, ValueError, KeyError):
        return {}


def _loss(ax: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    pts = [(r["step"], r["loss"]) for r in train if finite(r.get("loss"))]
    if pts:
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", linewidth=1, label="train loss (per log interval)")
    val = [(r["step"], r["val_loss"]) for r in evals if finite(r.get("val_loss"))]
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], marker="o", linewidth=1, label="validation loss")
    ax.set_title("loss over the steps", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if pts or val:
        ax.legend(fontsize=7)


def _throughput(ax: Any, train: list[dict[str, Any]], s: dict[str, Any]) -> None:
    pts = [(r["step"], r["tokens_per_s"]) for r in train if finite(r.get("tokens_per_s"))]
    if pts:
        ax.plot([p for p, _ in pts], [v for _, v in pts], marker=".", linewidth=1, label="tokens/s per log interval")
    warmup = ((s.get("config") or {}).get("timing_warmup_steps"))
    start = s.get("start_step") or 0
    if isinstance(warmup, int) and warmup > 0 and pts:
        ax.axvspan(start, start + warmup, color="gray", alpha=0.15, label=f"warm-up ({warmup} steps, out of the median)")
    med = s.get("tokens_per_s_median")
    if finite(med):
        ax.axhline(med, color="tab:green", linestyle="--", linewidth=1,
                   label=f"median of the steady steps: {med:,.0f}")
    ax.set_title("tokens/s over the steps", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    if pts or finite(med):
        ax.legend(fontsize=7)


def _machine(row: Row) -> str:
    if row.contended:
        return "shared the machine: " + "; ".join(row.contention)
    return "had the machine to itself" if row.contended is False else "sharing of the machine not assessed"


def run_figure(report: Report, row: Row) -> Any:
    """Loss and tokens/s over the steps of one run (raises ImportError without matplotlib)."""
    from matplotlib.figure import Figure

    job = report.paths[row.job]
    train, evals, s = train_records(job), train_records(job, "eval"), _summary(report, row)
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax_loss, ax_tps = fig.subplots(1, 2)
    _loss(ax_loss, train, evals)
    _throughput(ax_tps, train, s)
    for ax in (ax_loss, ax_tps):
        if not ax.lines:
            ax.text(0.5, 0.5, "no figures recorded (metrics.jsonl)", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    where = f" on {row.device_name}" if row.device_name else ""
    fig.suptitle(wrap(f"perfrun run {row.job}{where}: {row.status}; {_machine(row)}", 11, 10), fontsize=10)
    tps = f"{row.tokens_per_s:,.0f} tokens/s (median of the steady steps)" if finite(row.tokens_per_s) else "no tokens/s"
    loss = f", final train loss {row.final_train_loss:.4f}" if finite(row.final_train_loss) else ""
    val = f", val loss {row.final_val_loss:.4f}" if finite(row.final_val_loss) else ""
    fig.supxlabel(tps + loss + val, fontsize=9)
    return fig
