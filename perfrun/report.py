"""Run, sweep and tune summaries: one table, a plot, CSV/JSON/HTML, and the ablation.

One source of truth: every row is read back from a job's ``summary.json`` (and, for loss
parity, its ``metrics.jsonl``). The sweep callback (:mod:`perfrun.sweep`) and ``perfrun
report`` both call :func:`load` and the same renderers, so the report of a sweep dir
reproduces the table, CSV and JSON the sweep wrote, byte for byte.

``perfrun report PATH... [--csv | --json | --markdown] [--html FILE] [--plot FILE]``

**Loss parity** (ablation sweeps, ``+sweep=ablation``). Each knob's training-loss curve is
compared with the fp32 baseline's at the steps both logged. The figure judged is the
relative difference of the mean train loss over the tail of the run: the last
``--loss-window`` fraction (default 20 %) of the common logged steps, at least one record,
each record being itself the mean loss over ``log_every`` steps. Averaging over the tail
keeps step-to-step noise out; comparing at the end catches a knob that slowly derails
training (fp16 overflow, lost gradients) rather than the expected, harmless
early-trajectory wiggle of changed rounding. The tolerance (``--loss-tol``, default 2 %)
is stated in the output, and each knob over it is flagged. The largest relative difference
at any common step is shown beside it, for information only.

Why 2 %: in the measured ablation of GPT-2 (124M) on an H100 (batch 8 x 1024 tokens, 100
steps; ``perfrun report --markdown`` of that sweep), the knobs that change only rounding
moved the tail mean by at most 0.81 % (bf16; fp16 0.62 %, all knobs 0.42 %, the others
under 0.03 %), while their per-step difference reached 8.7 % early on (fp16 over the
first ten steps, where its loss scaler skipped a step: the scale fell from 2^16 to 2^15),
which is why the tail and not the worst step is judged. 2 %
leaves those a margin of more than two, and still flags a knob that costs a fortieth of
the loss. On a tiny CPU model the same knobs stayed within 0.01 %.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text  # cells from files are shown as written, never read as rich markup

from perfrun.atomic import atomic_write
from perfrun.console import error, warn, wide_console

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
ABLATION_KEY = "ablation"
BASELINE = "baseline"
DEFAULT_LOSS_TOL = 0.02
DEFAULT_LOSS_WINDOW = 0.2
PLOT_HINT = 'pip install "perfrun[plot]"'

# Output files of a sweep (written by the callback into the sweep dir).
SWEEP_CSV = "sweep_summary.csv"
SWEEP_JSON = "sweep_summary.json"
SWEEP_PNG = "sweep_summary.png"


class ReportError(ValueError):
    """A bad path or option: one line, exit 2."""


@dataclass
class Row:
    """One job, as its summary.json tells it."""

    job: str  # its dir relative to the sweep dir (prefixed by the root when several are given)
    root: str  # the directory the user named, when several were given; "" for one
    overrides: list[str]
    status: str  # completed | failed | missing | unreadable | running (stopped without finishing)
    reason: str | None
    tokens_per_s: float | None  # median over the steady steps
    mfu: float | None  # fraction of the peak
    peak_mem_mib: float | None
    data_wait_pct: float | None
    final_train_loss: float | None
    final_val_loss: float | None
    first_step_s: float | None
    peak_mem_source: str | None = None
    device_name: str | None = None
    software: str | None = None  # torch (and CUDA) versions the job ran with
    knobs: dict[str, Any] = field(default_factory=dict)
    swept: dict[str, str | None] = field(default_factory=dict)  # the swept keys' values
    best: bool = False


@dataclass
class Report:
    """Rows of one or several dirs, the keys that vary between them, and the best row."""

    rows: list[Row]
    swept_keys: list[str]
    best: str | None  # job label of the highest tokens/s
    ablations: list[dict[str, Any]] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)  # job label -> job dir (not serialised)


# ------------------------------------------------------------------------------- reading


def _natural(path: Path) -> list[Any]:
    """Sort key: job 10 after job 9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.as_posix())]


def override_key(override: str) -> tuple[str, str | None]:
    """``+ablation=bf16`` -> (``ablation``, ``bf16``); ``~key`` -> (``key``, None)."""
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), (value if sep else None)


def job_dirs(root: Path) -> list[Path]:
    """The job dirs under ``root``: those with a summary.json or a Hydra job record."""
    if (root / SUMMARY).is_file():
        return [root]
    found = {p.parent for p in root.rglob(SUMMARY)}
    found |= {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    found.discard(root)
    return sorted(found, key=lambda p: _natural(p.relative_to(root)))


def _read_overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def read_row(job: Path, label: str, root_label: str) -> Row:
    """One row from ``job/summary.json``; a missing or unreadable file becomes a row that says so."""
    empty = dict(tokens_per_s=None, mfu=None, peak_mem_mib=None, data_wait_pct=None,
                 final_train_loss=None, final_val_loss=None, first_step_s=None)
    path = job / SUMMARY
    if not path.is_file():
        return Row(label, root_label, _read_overrides(job), "missing",
                   "no summary.json: the job was killed before it could write one (see its train.log)", **empty)
    try:
        s = json.loads(path.read_text())
        if not isinstance(s, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return Row(label, root_label, _read_overrides(job), "unreadable", f"summary.json: {e}", **empty)
    status = str(s.get("status", "unknown"))
    reason = s.get("reason")
    if status not in ("completed", "failed") and reason is None:
        reason = "the job stopped without finishing (interrupted or crashed; see its train.log)"
    env = s.get("environment") or {}
    return Row(
        job=label, root=root_label, overrides=[str(o) for o in s.get("overrides") or _read_overrides(job)],
        status=status, reason=reason,
        tokens_per_s=s.get("tokens_per_s_median"), mfu=s.get("mfu_median"), peak_mem_mib=s.get("peak_mem_mib"),
        data_wait_pct=s.get("data_wait_pct"), final_train_loss=s.get("final_train_loss"),
        final_val_loss=s.get("final_val_loss"), first_step_s=s.get("first_step_s"),
        peak_mem_source=s.get("peak_mem_source"), device_name=env.get("device_name"),
        software=(f"torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")) if env.get("torch") else None,
        knobs=s.get("knobs") or {},
    )


def train_losses(job: Path) -> dict[int, float]:
    """step -> train loss from metrics.jsonl (the last record of a step wins, as after a resume)."""
    curve: dict[int, float] = {}
    try:
        lines = (job / METRICS).read_text().splitlines()
    except OSError:
        return curve
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(r, dict) and r.get("kind") == "train" and isinstance(r.get("loss"), (int, float)):
            curve[int(r["step"])] = float(r["loss"])
    return curve


def swept_keys(rows: Sequence[Row]) -> list[str]:
    """Override keys whose value is not the same in every row, in order of appearance."""
    values: dict[str, set[str | None]] = {}
    parsed = [dict(override_key(o) for o in r.overrides) for r in rows]
    for p in parsed:
        for k in p:
            values.setdefault(k, set())
    for k in values:
        values[k] = {p.get(k) for p in parsed}
    return [k for k, v in values.items() if len(v) > 1]


def load(
    paths: Sequence[Path | str], *, loss_tol: float = DEFAULT_LOSS_TOL, loss_window: float = DEFAULT_LOSS_WINDOW
) -> Report:
    """Rows of every job under ``paths``, with the swept keys, the best row and any ablation."""
    rows: list[Row] = []
    dirs: dict[str, Path] = {}
    several = len(paths) > 1
    for given in paths:
        root = Path(given)
        if root.is_file() and root.name == SUMMARY:
            root = root.parent
        if not root.exists():
            raise ReportError(f"{given} does not exist; give a run, sweep or tune directory (e.g. outputs/multirun/DATE/TIME)")
        if not root.is_dir():
            raise ReportError(f"{given} is a file, not a run or sweep directory; give the directory that holds summary.json")
        jobs = job_dirs(root)
        if not jobs:
            raise ReportError(f"{given} holds no summary.json: it is not a perfrun run, sweep or tune directory")
        root_label = str(given) if several else ""  # one dir: nothing depends on how it was spelt
        for job in jobs:
            rel = job.relative_to(root).as_posix()
            label = root.name if rel == "." else rel
            if several:
                label = root_label if rel == "." else f"{root_label}/{rel}"
            rows.append(read_row(job, label, root_label))
            dirs[label] = job
    keys = swept_keys(rows)
    if several and len({r.root for r in rows}) > 1:
        keys = ["source", *keys]
    for r in rows:
        parsed = dict(override_key(o) for o in r.overrides)
        r.swept = {k: (r.root if k == "source" else parsed.get(k)) for k in keys}
    done = [r for r in rows if r.status == "completed" and _finite(r.tokens_per_s)]
    best = max(done, key=lambda r: r.tokens_per_s) if done else None  # type: ignore[arg-type,return-value]
    if best is not None:
        best.best = True
    report = Report(rows, keys, best.job if best else None, paths=dirs)
    report.ablations = ablations(report, loss_tol=loss_tol, loss_window=loss_window)
    return report


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------------- ablation


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if _finite(a) and _finite(b) and b else None  # type: ignore[operator]


def loss_parity(knob: dict[int, float], base: dict[int, float], window: float) -> dict[str, Any]:
    """Relative difference of the tail-mean train loss (see the module doc), and the curve's max."""
    common = sorted(set(knob) & set(base))
    if not common:
        return {"steps": [], "rel_diff": None, "max_rel_diff": None}
    k = max(1, math.ceil(window * len(common)))
    tail = common[-k:]
    mean_knob = sum(knob[s] for s in tail) / k
    mean_base = sum(base[s] for s in tail) / k
    rel = (mean_knob - mean_base) / abs(mean_base) if mean_base else None
    diffs = [abs(knob[s] - base[s]) / abs(base[s]) for s in common if base[s]]
    return {
        "steps": [tail[0], tail[-1]], "records": k, "loss": mean_knob, "baseline_loss": mean_base,
        "rel_diff": rel, "max_rel_diff": max(diffs) if diffs else None,
    }


def ablations(report: Report, *, loss_tol: float, loss_window: float) -> list[dict[str, Any]]:
    """Per root that ran ``+ablation=...`` jobs with a baseline: each knob against the baseline."""
    out = []
    for root in dict.fromkeys(r.root for r in report.rows):
        rows = [r for r in report.rows if r.root == root]
        named = {r.job: dict(override_key(o) for o in r.overrides).get(ABLATION_KEY) for r in rows}
        rows = [r for r in rows if named[r.job] is not None]
        if not rows:
            continue
        base = next((r for r in rows if named[r.job] == BASELINE), None)
        result: dict[str, Any] = {
            "root": root, "baseline": base.job if base else None, "loss_tol": loss_tol, "loss_window": loss_window,
            "device_name": base.device_name if base else None, "software": base.software if base else None,
            "peak_mem_source": base.peak_mem_source if base else None, "knobs": [], "notes": [],
        }
        if base is None or base.status != "completed":
            result["notes"].append(
                "no completed baseline job (+ablation=baseline), so no ratio or parity can be computed"
            )
        else:
            off = {k: v for k, v in base.knobs.items() if k in ("precision", "compile", "checkpointing", "cudnn_benchmark") and v not in ("none", False, None)}
            source = base.peak_mem_source or ""
            if source and not source.startswith("cuda"):
                result["notes"].append(
                    f"peak memory is {source}: the whole process, which keeps what earlier jobs of the sweep "
                    "left in its allocator, so memory ratios after the first job are upper bounds"
                )
            if off:
                result["notes"].append(
                    "the baseline job is not a baseline: " + ", ".join(f"{k}={v}" for k, v in off.items())
                    + " (an override on the command line wins over the preset; drop it)"
                )
        base_curve = train_losses(report.paths[base.job]) if base and base.status == "completed" else {}
        for r in rows:
            done = r.status == "completed" and base is not None and base.status == "completed"
            parity = loss_parity(train_losses(report.paths[r.job]), base_curve, loss_window) if done else {}
            rel = parity.get("rel_diff")
            result["knobs"].append({
                "knob": named[r.job], "job": r.job, "status": r.status,
                "tokens_per_s": r.tokens_per_s,
                "speedup": _ratio(r.tokens_per_s, base.tokens_per_s) if done else None,  # type: ignore[union-attr]
                "peak_mem_mib": r.peak_mem_mib,
                "mem_ratio": _ratio(r.peak_mem_mib, base.peak_mem_mib) if done else None,  # type: ignore[union-attr]
                "first_step_s": r.first_step_s,
                "loss": parity.get("loss"),
                "loss_rel_diff": rel,
                "loss_max_rel_diff": parity.get("max_rel_diff"),
                "loss_steps": parity.get("steps"),
                "loss_records": parity.get("records"),
                "parity": ("n/a" if rel is None else "ok" if abs(rel) <= loss_tol else "EXCEEDED"),
            })
        out.append(result)
    return out


# ------------------------------------------------------------------------------- rendering

COLUMNS = ["job", "status", "tokens_per_s", "mfu", "peak_mem_mib", "data_wait_pct",
           "final_train_loss", "final_val_loss", "first_step_s", "best", "overrides", "reason"]


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    return format(v * scale, spec) if _finite(v) else "n/a"


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return ""
    return v


def to_csv(report: Report) -> str:
    """One line per job: the job, the swept keys' values, the figures (full precision)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    keys = [k for k in report.swept_keys]
    w.writerow(["job", *keys, *COLUMNS[1:]])
    for r in report.rows:
        d = asdict(r)
        d["overrides"] = " ".join(r.overrides)
        w.writerow([r.job, *(_csv_value(r.swept.get(k)) for k in keys), *(_csv_value(d[c]) for c in COLUMNS[1:])])
    return buf.getvalue()


def to_dict(report: Report) -> dict[str, Any]:
    return {
        "swept_keys": report.swept_keys,
        "best": report.best,
        "rows": [asdict(r) for r in report.rows],
        "ablation": report.ablations,
    }


def to_json(report: Report) -> str:
    from perfrun.atomic import json_safe

    return json.dumps(json_safe(to_dict(report)), indent=2, default=str) + "\n"


def _override_cell(r: Row, keys: Sequence[str]) -> str:
    shown = [k for k in keys if k != "source"]
    if shown:
        return " ".join(f"{k}={'—' if r.swept.get(k) is None else r.swept[k]}" for k in shown)
    return " ".join(r.overrides) or "(defaults)"


def table(report: Report) -> Table:
    """The rich table: one row per job, the best marked with a star."""
    mem_sources = sorted({r.peak_mem_source for r in report.rows if r.peak_mem_source})
    t = Table(
        title="perfrun: runs",
        caption=("★ best tokens/s (median of steady steps)"
                 + (f" · peak memory: {', '.join(mem_sources)}" if mem_sources else "")),
        caption_justify="left",
    )
    for name, justify in [("", "left"), ("job", "left"), ("overrides", "left"), ("status", "left"),
                          ("tok/s", "right"), ("MFU %", "right"), ("peak MiB", "right"),
                          ("data-wait %", "right"), ("train loss", "right"), ("val loss", "right")]:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in report.rows:
        style = "bold green" if r.best else ("red" if r.status != "completed" else None)
        t.add_row(
            "★" if r.best else "", Text(r.job), Text(_override_cell(r, report.swept_keys)), Text(r.status),
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.mfu, ".1f", 100), _fmt(r.peak_mem_mib, ",.0f"),
            _fmt(r.data_wait_pct, ".1f"), _fmt(r.final_train_loss, ".4f"), _fmt(r.final_val_loss, ".4f"),
            style=style,
        )
    return t


def _ablation_method(a: dict[str, Any]) -> str:
    return (
        f"loss parity: relative difference of the mean train loss over the last {a['loss_window']:.0%} of the "
        f"logged steps against the baseline (fp32) at the same steps; tolerance ±{a['loss_tol']:.1%}, "
        "EXCEEDED where over it"
    )


def ablation_table(a: dict[str, Any]) -> Table:
    """Per knob: speed-up, memory ratio, time to first step and loss parity against the baseline."""
    where = f" on {a['device_name']}" if a.get("device_name") else ""
    t = Table(
        title=f"ablation{where}: each knob against the baseline" + (f" ({a['root']})" if a["root"] else ""),
        caption=_ablation_method(a) + (f" · peak memory: {a['peak_mem_source']}" if a.get("peak_mem_source") else ""),
        caption_justify="left",
    )
    for name in ("knob", "status", "tok/s", "speed-up", "peak MiB", "mem ratio", "first step s",
                 "tail loss", "Δ loss", "max Δ", "parity"):
        t.add_column(name, justify="left" if name in ("knob", "status", "parity") else "right")
    for k in a["knobs"]:
        flagged = k["parity"] == "EXCEEDED"
        t.add_row(
            Text(str(k["knob"])), Text(k["status"]), _fmt(k["tokens_per_s"], ",.0f"), _fmt(k["speedup"], ".2f") + ("×" if _finite(k["speedup"]) else ""),
            _fmt(k["peak_mem_mib"], ",.0f"), _fmt(k["mem_ratio"], ".2f") + ("×" if _finite(k["mem_ratio"]) else ""),
            _fmt(k["first_step_s"], ".2f"), _fmt(k["loss"], ".4f"), _fmt(k["loss_rel_diff"], "+.2%"),
            _fmt(k["loss_max_rel_diff"], ".2%"), k["parity"],
            style="bold red" if flagged else ("red" if k["status"] != "completed" else None),
        )
    return t


def notes(report: Report) -> list[str]:
    """Lines printed under the table: why jobs failed, ablation notes."""
    lines = [f"{r.job}: {r.status}: {r.reason}" for r in report.rows if r.status != "completed" and r.reason]
    for a in report.ablations:
        where = f" ({a['root']})" if a["root"] else ""
        lines += [f"ablation{where}: {n}" for n in a["notes"]]
    return lines


def print_report(report: Report, console: Console | None = None) -> None:
    tables = [table(report)] + [ablation_table(a) for a in report.ablations if a["knobs"] and a["baseline"]]
    console = console or wide_console(tables)
    for t in tables:
        console.print(t)
    for line in notes(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_text(report: Report, width: int) -> str:
    """The printed report as plain text at ``width`` columns (tests compare the two paths)."""
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False, force_terminal=False)
    print_report(report, console)
    return console.file.getvalue()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------- plot


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
    """PNG of tokens/s against each swept key (one panel per key); None without matplotlib.

    matplotlib is an optional extra (``perfrun[plot]``). Its object API with the Agg canvas
    is used, not pyplot, so no global backend or figure state is touched.
    """
    try:
        return _draw(report)
    except ImportError:
        return None


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


def _draw(report: Report) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in report.rows if r.status == "completed" and _finite(r.tokens_per_s)]
    keys = report.swept_keys or ["job"]
    fig = Figure(figsize=(max(5.0, 4.6 * len(keys)), 3.8), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    failed = len(report.rows) - len(done)
    for ax, key in zip(axes, keys, strict=True):
        if key == "job":
            labels = [r.job for r in done]
            ax.bar(range(len(done)), [r.tokens_per_s for r in done],
                   color=["tab:green" if r.best else "tab:blue" for r in done])
            ax.set_xticks(range(len(done)), labels=labels, rotation=30, ha="right", fontsize=8)
        else:
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
        ax.set_xlabel(key)
        ax.set_ylabel("tokens/s (median of steady steps)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("tokens/s" + (f" ({failed} job(s) without a figure: failed or unfinished)" if failed else ""),
                 fontsize=10)
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def no_plot_warning() -> None:
    warn(f"matplotlib is not installed, so no plot was drawn; {PLOT_HINT} for the plot")


def to_html(report: Report, png: bytes | None) -> str:
    """A static page: the table, the ablation table and the plot, with nothing to fetch."""

    def cell(v: Any) -> str:
        return f"<td>{html.escape(str(v))}</td>"

    head = ["", "job", "overrides", "status", "tok/s", "MFU %", "peak MiB", "data-wait %", "train loss", "val loss"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>perfrun report</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:nth-child(-n+4){text-align:left}"
        "tr.best{background:#e6ffe6;font-weight:bold}tr.bad{color:#b00}caption{caption-side:bottom;text-align:left;"
        "color:#555;font-size:90%}",
        "</style></head><body><h1>perfrun report</h1>",
        "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>",
    ]
    for r in report.rows:
        cls = "best" if r.best else ("bad" if r.status != "completed" else "")
        parts.append(f"<tr class='{cls}'>" + "".join(cell(v) for v in (
            "★" if r.best else "", Text(r.job), Text(_override_cell(r, report.swept_keys)), Text(r.status),
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.mfu, ".1f", 100), _fmt(r.peak_mem_mib, ",.0f"),
            _fmt(r.data_wait_pct, ".1f"), _fmt(r.final_train_loss, ".4f"), _fmt(r.final_val_loss, ".4f"),
        )) + "</tr>")
    parts.append("<caption>★ best tokens/s (median of steady steps)</caption></table>")
    for a in report.ablations:
        if not a["knobs"] or not a["baseline"]:
            continue
        where = f" on {a['device_name']}" if a.get("device_name") else ""
        parts.append(f"<h2>Ablation{html.escape(where)}</h2><table><tr>" + "".join(
            f"<th>{h}</th>" for h in ("knob", "status", "tok/s", "speed-up", "peak MiB", "mem ratio",
                                      "first step s", "tail loss", "Δ loss", "max Δ", "parity")) + "</tr>")
        for k in a["knobs"]:
            cls = "bad" if k["parity"] == "EXCEEDED" or k["status"] != "completed" else ""
            parts.append(f"<tr class='{cls}'>" + "".join(cell(v) for v in (
                Text(str(k["knob"])), Text(k["status"]), _fmt(k["tokens_per_s"], ",.0f"), _fmt(k["speedup"], ".2f"),
                _fmt(k["peak_mem_mib"], ",.0f"), _fmt(k["mem_ratio"], ".2f"), _fmt(k["first_step_s"], ".2f"),
                _fmt(k["loss"], ".4f"), _fmt(k["loss_rel_diff"], "+.2%"), _fmt(k["loss_max_rel_diff"], ".2%"),
                k["parity"],
            )) + "</tr>")
        parts.append(f"<caption>{html.escape(_ablation_method(a))}</caption></table>")
    extra = notes(report)
    if extra:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in extra) + "</ul>")
    if png is not None:
        parts.append("<img alt='tokens/s against each swept key' src='data:image/png;base64,"
                     + base64.b64encode(png).decode() + "'>")
    else:
        parts.append(f"<p>No plot: matplotlib is not installed ({html.escape(PLOT_HINT)}).</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def common_overrides(report: Report) -> list[str]:
    """Overrides every job was given (what the table's per-row column leaves out)."""
    if not report.rows:
        return []
    first = report.rows[0].overrides
    return [o for o in first if all(o in r.overrides for r in report.rows[1:])]


def to_markdown(report: Report) -> str:
    """GitHub Markdown: the runs table, then each ablation with its machine and method named."""

    def row(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    def machine(rows: Sequence[Row]) -> str:
        named = dict.fromkeys(f"{r.device_name}" + (f" ({r.software})" if r.software else "")
                              for r in rows if r.device_name)
        return ", ".join(named) or "an unrecorded machine"

    head = ["", "job", "overrides", "status", "tok/s", "MFU %", "peak MiB", "data-wait %", "train loss", "val loss"]
    out = [f"Runs on {machine(report.rows)}."]
    common = common_overrides(report)
    if common and report.swept_keys:
        out.append(f"Every job: `{' '.join(common)}`.")
    out += ["", row(head), row(["---"] * len(head))]
    for r in report.rows:
        out.append(row([
            "★" if r.best else "", r.job, _override_cell(r, report.swept_keys), r.status,
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.mfu, ".1f", 100), _fmt(r.peak_mem_mib, ",.0f"),
            _fmt(r.data_wait_pct, ".1f"), _fmt(r.final_train_loss, ".4f"), _fmt(r.final_val_loss, ".4f"),
        ]))
    out += ["", "★ best tokens/s (median of steady steps)."]
    for a in report.ablations:
        if not a["knobs"] or not a["baseline"]:
            continue
        where = a.get("device_name") or "an unrecorded machine"
        if a.get("software"):
            where += f" ({a['software']})"
        head = ["knob", "status", "tok/s", "speed-up", "peak MiB", "mem ratio", "first step s", "tail loss",
                "Δ loss", "max Δ", "parity"]
        out += ["", f"Ablation on {where}" + (f" ({a['root']})" if a["root"] else "") + ":", "",
                row(head), row(["---"] * len(head))]
        for k in a["knobs"]:
            out.append(row([
                k["knob"], k["status"], _fmt(k["tokens_per_s"], ",.0f"), _fmt(k["speedup"], ".2f"),
                _fmt(k["peak_mem_mib"], ",.0f"), _fmt(k["mem_ratio"], ".2f"), _fmt(k["first_step_s"], ".2f"),
                _fmt(k["loss"], ".4f"), _fmt(k["loss_rel_diff"], "+.2%"), _fmt(k["loss_max_rel_diff"], ".2%"),
                k["parity"],
            ]))
        out += ["", _ablation_method(a) + (f"; peak memory: {a['peak_mem_source']}" if a.get("peak_mem_source") else "") + "."]
    notes_ = notes(report)
    if notes_:
        out += [""] + [f"- {n}" for n in notes_]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------- sweep files


def write_sweep_summary(sweep_dir: Path, console: Console | None = None) -> Report:
    """What the sweep callback does: CSV, JSON and PNG in ``sweep_dir``, and the printed table."""
    report = load([sweep_dir])
    atomic_write(sweep_dir / SWEEP_CSV, to_csv(report))
    atomic_write(sweep_dir / SWEEP_JSON, to_json(report))
    png = plot_or_warn(report)
    if png is not None:
        atomic_write(sweep_dir / SWEEP_PNG, png)
    print_report(report, console)
    written = [SWEEP_CSV, SWEEP_JSON] + ([SWEEP_PNG] if png is not None else [])
    (console or Console(highlight=False, soft_wrap=True)).print(
        f"sweep summary: {', '.join(str(sweep_dir / n) for n in written)}", markup=False, highlight=False)
    return report


# ------------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ReportError(f"{message} (perfrun report --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="perfrun report",
        description="The table and plot of runs, sweeps and tunes after the fact (read from each job's summary.json).",
        epilog="examples:\n  perfrun report outputs/multirun/2025-01-01/12-00-00\n"
               "  perfrun report outputs/multirun/A outputs/multirun/B --html compare.html\n"
               "  perfrun report outputs/multirun/A --csv > runs.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="run, sweep or tune directories")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV to stdout instead of the table")
    fmt.add_argument("--json", action="store_true", help="print JSON to stdout instead of the table")
    fmt.add_argument("--markdown", action="store_true",
                     help="print Markdown tables (machine named) to stdout, e.g. for a README")
    p.add_argument("--html", metavar="FILE", help="also write a static HTML page (table and embedded plot)")
    p.add_argument("--plot", metavar="FILE", help="also write the PNG plot of tokens/s against each swept key")
    p.add_argument("--loss-tol", type=float, default=DEFAULT_LOSS_TOL,
                   help=f"ablation loss parity: relative tolerance (default {DEFAULT_LOSS_TOL})")
    p.add_argument("--loss-window", type=float, default=DEFAULT_LOSS_WINDOW,
                   help=f"ablation loss parity: tail fraction of the logged steps averaged (default {DEFAULT_LOSS_WINDOW})")
    return p


def main(argv: list[str]) -> int:
    """``perfrun report``: 0 on success, 2 on a bad path or option (one line, no traceback)."""
    try:
        args = _parser().parse_intermixed_args(argv)
        if not (args.loss_tol >= 0 and math.isfinite(args.loss_tol)):
            raise ReportError(f"--loss-tol {args.loss_tol} must be a number >= 0, e.g. 0.02 for 2%")
        if not 0 < args.loss_window <= 1:
            raise ReportError(f"--loss-window {args.loss_window} must be in (0, 1], e.g. 0.2 for the last 20%")
        report = load(args.paths, loss_tol=args.loss_tol, loss_window=args.loss_window)
        png = None
        if args.plot or args.html:
            png = plot_or_warn(report)
        if args.plot and png is not None:
            atomic_write(Path(args.plot), png)
        if args.html:
            atomic_write(Path(args.html), to_html(report, png))
    except ReportError as e:
        error(f"report: {e}")
        return 2
    except OSError as e:
        error(f"report: cannot write {e.filename}: {e.strerror}; choose a writable path")
        return 2
    if args.csv:
        sys.stdout.write(to_csv(report))
    elif args.json:
        sys.stdout.write(to_json(report))
    elif args.markdown:
        sys.stdout.write(to_markdown(report))
    else:
        print_report(report)
    return 0
