"""Where measurements go: metrics.jsonl (line by line, flushed), summary.json (atomic),
and the console (a rich progress bar on a terminal, plain lines otherwise)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from perfrun.atomic import json_safe

log = logging.getLogger("perfrun")


class JsonlSink:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line."""

    def __init__(self, path: Path | None) -> None:
        self._f = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(json_safe(record), default=str) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def log_handler(level: int = logging.NOTSET) -> logging.Handler:
    """Hydra's console log handler (conf/hydra/job_logging/rich.yaml).

    On a terminal: rich's handler on the shared console, so log lines print above the
    live progress bar instead of through it. Otherwise (a pipe, a file, a batch job):
    plain timestamped lines that are not wrapped at 80 columns.
    """
    from rich import get_console
    from rich.logging import RichHandler

    console = get_console()
    if console.is_terminal:
        return RichHandler(level=level, console=console, show_path=False, markup=False)
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    return handler


def _fmt_record(r: dict[str, Any]) -> str:
    parts = [f"step {r['step']}/{r['max_steps']}", f"loss {r['loss']:.4f}"]
    parts.append(f"lr {r['lr']:.2e}")
    if r.get("grad_norm") is not None:
        parts.append(f"gnorm {r['grad_norm']:.2f}")
    parts.append(f"{r['step_time_ms']:.1f} ms/step")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"data-wait {r['data_wait_pct']:.1f}%")
    if r.get("peak_mem_mib") is not None:
        parts.append(f"mem {r['peak_mem_mib']:,.0f} MiB")
    return " | ".join(parts)


_MONITOR_FIELDS = (  # key, label, number format, unit
    ("gpu_util_pct_mean", "GPU ", ".0f", "%"),
    ("gpu_mem_used_mib", "mem ", ",.0f", " MiB"),
    ("power_w_mean", "", ".0f", " W"),
    ("temp_c_max", "", ".0f", " C"),
    ("sm_clock_mhz_mean", "SM ", ".0f", " MHz"),
    ("energy_j", "", ".1f", " J"),
    ("host_cpu_pct_mean", "host CPU ", ".0f", "%"),
    ("rss_mib_max", "RSS ", ",.0f", " MiB"),
    ("workers_cpu_pct_mean", "workers CPU ", ".0f", "%"),
)


def _fmt_monitor(step: int, r: dict[str, Any], ranks: list[dict[str, Any]] | None = None) -> str:
    """One console line per telemetry sample; fields that are N/A are left out. With
    several ranks, each field lists every rank's value, rank 0 first (``GPU 98/97%``)."""
    rows = ranks or [r]
    parts = [f"monitor step {step}" + (f" (ranks {'/'.join(str(i) for i in range(len(rows)))})" if ranks else "")]
    for key, label, spec, unit in _MONITOR_FIELDS:
        values = [row.get(key) for row in rows]
        if any(v is not None for v in values):
            parts.append(label + "/".join("-" if v is None else format(v, spec) for v in values) + unit)
    reasons = r.get("throttle_reasons")
    if reasons is not None:
        parts.append("throttle: " + (", ".join(reasons) if reasons else "none"))
    return " | ".join(parts)


class ConsoleReporter:
    """Live progress for a person, or plain periodic lines for a log file; nothing off rank 0."""

    def __init__(self, mode: str, max_steps: int, enabled: bool = True, console: Console | None = None) -> None:
        from rich import get_console

        self.console = console or get_console()  # the same console as Hydra's RichHandler
        if not enabled or mode == "off":
            self.mode = "off"
        elif mode == "auto":
            self.mode = "bar" if self.console.is_terminal else "plain"
        else:
            self.mode = mode
        self._progress: Progress | None = None
        self._task = None
        self.max_steps = max_steps

    def __enter__(self) -> ConsoleReporter:
        if self.mode == "bar":
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[live]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.max_steps, live="")
        return self

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def train(self, record: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        if self._progress is not None:
            live = f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s"
            self._progress.update(self._task, completed=record["step"], live=live)
        log.info(_fmt_record(record))

    def monitor(self, step: int, record: dict[str, Any], ranks: list[dict[str, Any]] | None = None) -> None:
        if self.mode != "off":
            log.info(_fmt_monitor(step, record, ranks))

    def line(self, text: str) -> None:
        if self.mode != "off":
            log.info(text)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
