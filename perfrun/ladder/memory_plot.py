"""What each knob saves of which memory, in the ladder: every rung's breakdown (the median,
category by category, of its jobs' ``memory.breakdown`` in summary.json), the trade-offs'
verdict naming the category a memory knob acts on ("checkpointing=full freed 1.2 GiB of
activations for 23 % of speed"), and the figure: one stacked bar per rung, the categories
in a fixed colour order, each trade-off's bar labelled with the category it freed, the
device's memory as a line (``memory_breakdown.png``).

matplotlib's object API with the Agg canvas, as :mod:`perfrun.report.plot`.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

# the tracker's categories in the order summary.json keeps them (perfrun/memory/tracker.py),
# each with its fixed colour
COLOURS = {"Parameter": "tab:blue", "Buffer": "tab:gray", "Gradient": "tab:orange", "Optstate": "tab:purple",
           "Activation": "tab:green", "Temp": "tab:red"}
CATEGORIES = tuple(COLOURS)
MEMORY_PNG = "memory_breakdown.png"


def rung_breakdown(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The median bytes of each category (and of the peak, the measured peak and the
    allocator's reserved-but-free bytes) over the jobs that tracked a step; None if none did."""
    found = [(s.get("memory") or {}).get("breakdown") or {} for s in summaries]
    found = [b for b in found if b.get("categories_bytes")]
    if not found:
        return None
    def med(values: list[Any]) -> float | None:
        values = [v for v in values if isinstance(v, int | float)]
        return statistics.median(values) if values else None
    device_gib = med([(s.get("environment") or {}).get("device_memory_gib") for s in summaries])
    return {"categories_bytes": {c: med([b["categories_bytes"].get(c, 0) for b in found]) or 0 for c in CATEGORIES},
            "peak_bytes": med([b.get("peak_bytes") for b in found]),
            "measured_peak_bytes": med([b.get("measured_peak_bytes") for b in found]),
            "reserved_free_bytes": med([b.get("reserved_free_bytes") for b in found]),
            "device_memory_bytes": device_gib * 2**30 if device_gib else None, "jobs": len(found)}


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


NAMES = {"Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer state",
         "Parameter": "parameters", "Gradient": "gradients", "Buffer": "buffers"}


def freed(setting: str, line: dict[str, Any], base: dict[str, Any]) -> tuple[str, float] | None:
    """The category ``setting`` took most from against ``base`` (the top rung without it), and
    the bytes; None without both breakdowns. Under checkpointing the recomputed activations
    count as Temp, so the activations freed are Activation + Temp."""
    b, a = (base.get("memory_breakdown") or {}), (line.get("memory_breakdown") or {})
    if not a or not b or line is base:
        return None
    cb, ca = dict(b["categories_bytes"]), dict(a["categories_bytes"])
    if setting.startswith("checkpointing"):
        for d in (cb, ca):
            d["Activation"] = d.get("Activation", 0) + d.pop("Temp", 0)
    saved = {c: cb[c] - ca.get(c, 0) for c in cb}
    category = max(saved, key=lambda c: saved[c])
    return category, saved[category]


def saving_text(setting: str, line: dict[str, Any], base: dict[str, Any]) -> str | None:
    """``checkpointing=full freed 1.2 GiB of activations for 23 % of speed``: what
    :func:`freed` found, with the speed it cost; None without both breakdowns."""
    found = freed(setting, line, base)
    if found is None:
        return None
    category, saved = found
    a, b = line["memory_breakdown"], base["memory_breakdown"]
    if saved <= 0:
        return f"{setting} freed no memory (peak {_size(a['peak_bytes'] or 0)} against {_size(b['peak_bytes'] or 0)})"
    text = f"{setting} freed {_size(saved)} of {NAMES[category]}"
    tps, tps_base = line.get("tokens_per_s"), base.get("tokens_per_s")
    if tps and tps_base:
        change = 100 * (1 - tps / tps_base)
        text += f" for {change:.0f} % of speed" if change > 0 else f" and ran {-change:.0f} % faster"
    return text


def add_savings(lines: list[dict[str, Any]], base_setting: str = "checkpointing=none") -> None:
    """Each trade-off line's ``memory_verdict`` against the line of ``base_setting``."""
    base = next((t for t in lines if t.get("setting") == base_setting), None)
    for t in lines:
        text = saving_text(str(t.get("setting")), t, base) if base is not None else None
        if text is not None:
            t["memory_verdict"] = text
        found = freed(str(t.get("setting")), t, base) if base is not None else None
        if found is not None and found[1] > 0:  # the plot labels the bar with it
            t["memory_freed"] = {"category": found[0], "bytes": found[1]}


def bar_labels(ablation: dict[str, Any]) -> dict[str, str]:
    """The label over each trade-off's bar: the category it freed and how much (``-1.2 GiB
    optimizer state``)."""
    return {t["setting"]: f"-{_size(t['memory_freed']['bytes'])} {NAMES[t['memory_freed']['category']]}"
            for t in ablation.get("tradeoffs", []) if t.get("memory_freed") and t.get("memory_breakdown")}


def bars(ablation: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, breakdown) of every rung and trade-off that carries one, in the report's order."""
    out = []
    for part in ("ladder", "alternatives", "leave_one_out"):
        out += [(e["rung"], e["memory_breakdown"]) for e in ablation.get(part, []) if e.get("memory_breakdown")]
    out += [(t["setting"], t["memory_breakdown"]) for t in ablation.get("tradeoffs", []) if t.get("memory_breakdown")]
    return out


def memory_png(ablation: dict[str, Any]) -> bytes | None:
    """One stacked bar per rung (bytes of each category at the tracked step's peak), the
    device's memory as a dashed line; None when no rung tracked a step or without matplotlib."""
    shown = bars(ablation)
    if not shown:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(max(6.0, 0.55 * len(shown) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(shown))
    bottom = [0.0] * len(shown)
    for c in CATEGORIES:
        heights = [b["categories_bytes"].get(c, 0) / 2**30 for _, b in shown]
        ax.bar(xs, heights, bottom=bottom, color=COLOURS[c], label=c)
        bottom = [lo + h for lo, h in zip(bottom, heights, strict=True)]
    labels = bar_labels(ablation)
    for x, (label, _) in enumerate(shown):  # which category each memory trade-off freed
        if label in labels:
            ax.text(x, bottom[x], labels[label], rotation=90, ha="center", va="bottom", fontsize=7)
    device = next((b["device_memory_bytes"] for _, b in shown if b.get("device_memory_bytes")), None)

    if device:
        ax.axhline(device / 2**30, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_xticks(list(xs), labels=[label for label, _ in shown], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("GiB at the tracked step's peak")
    ax.set_title(f"where the memory goes, per rung{' (' + ablation['root'] + ')' if ablation.get('root') else ''}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
