"""What every perfrun figure shares: how a job that does not stand is drawn (hollow, apart,
labelled, on no line), the line that counts the jobs that shared the machine, text wrapped to
the image, and the PNG bytes (the Agg canvas: no global backend state)."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from perfrun.report.rows import Row, finite


def png(fig: Any) -> bytes:
    """The figure as PNG bytes (the Agg canvas: no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


#: how a job that does not stand is drawn: hollow, apart, never on a line
APART = {"contended": dict(marker="o", markeredgecolor="tab:red", label="shared the machine: not counted"),
         "unknown": dict(marker="s", markeredgecolor="tab:orange", label="sharing of the machine unknown: not counted"),
         "outlier": dict(marker="D", markeredgecolor="tab:purple", label="outlier of its repeats: not counted"),
         "failed": dict(marker="X", markeredgecolor="dimgray", label="failed or unfinished: no figure")}


def standing(r: Row) -> bool:
    """A job whose figure counts: completed, with tokens/s, and measured to have had the machine."""
    return r.status == "completed" and r.quiet and finite(r.tokens_per_s)


def draw_apart(ax: Any, points: dict[str, list[tuple[float, float, str]]]) -> None:
    """Hollow markers, one artist per kind (no line between them), each labelled with its job."""
    for kind, pts in points.items():
        if not pts:
            continue
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], linestyle="none", markerfacecolor="none",
                markersize=9, markeredgewidth=1.5, **APART[kind])
        for x, y, text in pts:
            ax.annotate(text, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=6,
                        color=APART[kind]["markeredgecolor"])
    if any(points.values()):
        ax.legend(fontsize=7)


def wrap(text: str, width_in: float, fontsize: float = 9) -> str:
    """``text`` broken into lines that fit a figure ``width_in`` inches wide."""
    return textwrap.fill(text, max(40, int(width_in * 110 / fontsize)))


def contended_line(rows: list[Row]) -> str:
    """How many jobs shared the machine: said on every image."""
    k, unknown = sum(1 for r in rows if r.contended), sum(1 for r in rows if r.machine_unknown)
    line = f"{k} of {len(rows)} jobs shared the machine (hollow, not counted)" if k else \
        f"no job of {len(rows)} shared the machine"
    return line + (f"; {unknown} not measured for it (hollow, not counted)" if unknown else "")
