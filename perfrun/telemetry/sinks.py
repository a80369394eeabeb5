"""Where measurements go: metrics.jsonl (line by line, flushed), and the console: a rich
progress bar on a terminal, plain lines otherwise, and one log line per log point that
fits the console's width (80 columns: step, loss, tokens/s, MFU or data wait, memory,
and on CUDA the GPU's utilisation, power and temperature)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from perfrun.checkpoint.atomic import json_safe
from perfrun.telemetry.nvml import SLOWDOWN_REASONS

log = logging.getLogger("perfrun")


class RecordSink(Protocol):
    """Where the loop's records go: metrics.jsonl, and the experiment logger beside it."""

    def write(self, record: dict[str, Any]) -> None: ...


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


# rich redraws in a thread that holds the GIL the step's Python waits for, so fewer redraws than its
# default 10 a second leave the step more; 2 a second still reads as live (docs/measurements.md
# has what each costs, and the command that measures it)
PROGRESS_REFRESH_PER_S = 2
TIME_FORMAT = "%H:%M:%S"  # every console line, Hydra's own included: "06:12:01 message"
TIME_WIDTH = len("00:00:00 ")


class ConsoleFormatter(logging.Formatter):
    """``HH:MM:SS message``; warnings and errors say so. ``with_time=False`` leaves the
    time to rich's handler, which prints it in its own column in the same format."""

    def __init__(self, with_time: bool = True) -> None:
        super().__init__("%(asctime)s %(message)s" if with_time else "%(message)s", datefmt=TIME_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        if record.levelno >= logging.WARNING:
            record = logging.makeLogRecord({**record.__dict__, "message": f"{record.levelname.lower()}: {record.message}"})
        return super().formatMessage(record)


def log_handler(level: int = logging.NOTSET) -> logging.Handler:
    """The console log handler of Hydra's job and own logging (conf/hydra/*_logging/rich.yaml).

    On a terminal: rich's handler on the shared console, so log lines print above the
    live progress bar instead of through it. Otherwise (a pipe, a file, a batch job):
    the same lines, plain and unwrapped.
    """
    from rich import get_console
    from rich.logging import RichHandler

    console = get_console()
    if console.is_terminal:
        handler: logging.Handler = RichHandler(
            level=level, console=console, show_path=False, show_level=False, markup=False,
            log_time_format=TIME_FORMAT, omit_repeated_times=False)
        handler.setFormatter(ConsoleFormatter(with_time=False))
        return handler
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(level)
    handler.setFormatter(ConsoleFormatter())
    return handler


def shown_path(path: Path | str) -> str:
    """A path as short as it can be said: relative to the current folder when inside it."""
    try:
        return str(Path(path).absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def si(value: float) -> str:
    """Three significant figures with k, M or G: 987, 34.3k, 1.23M."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            x = value / scale
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f}{unit}"
    return f"{value:.0f}"


def mib(value: float) -> str:
    """Memory as top prints it: 419M, 9.5G, 45G."""
    if value < 1000:
        return f"{value:.0f}M"
    return f"{value / 1024:.{1 if value < 10 * 1024 else 0}f}G"


def percent(pct: float) -> str:
    """45%, or 4.5% where a decimal still says something."""
    return f"{pct:.{1 if pct < 10 else 0}f}%"


def spread(values: list[float | None]) -> str | None:
    """One rank's figure, or the range over several (``95-98``); None when none measured it."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    low, high = f"{min(known):.0f}", f"{max(known):.0f}"
    return low if low == high else f"{low}-{high}"


# the GPU figures folded into the step line: key in the monitor record, and its label
GPU_FIELDS = (("gpu_util_pct_mean", "GPU {}%"), ("power_w_mean", "{}W"), ("temp_c_max", "{}C"))


def gpu_parts(sample: dict[str, Any] | None, ranks: list[dict[str, Any]] | None = None) -> list[str]:
    """``GPU 98%``, ``690W``, ``71C`` from a monitor sample (ranges over several ranks)."""
    rows = ranks or ([sample] if sample else [])
    parts = []
    for key, label in GPU_FIELDS:
        shown = spread([row.get(key) for row in rows])
        if shown is not None:
            parts.append(label.format(shown))
    return parts


def data_figure(r: dict[str, Any]) -> str:
    """What the data cost the step: on CUDA with host data, the share of the step the GPU sat
    starved for its next batch (device events); elsewhere the host's wait for the DataLoader,
    which is not a GPU's idle time."""
    if r.get("gpu_starved_pct") is not None:
        return f"starved {r['gpu_starved_pct']:.1f}%"
    wait = r.get("host_data_wait_pct", r.get("data_wait_pct"))
    return "host wait n/a" if wait is None else f"host wait {wait:.1f}%"


def window_figure(r: dict[str, Any]) -> str:
    """The log point's tokens/s over its window's steady steps (the warm-up steps, which the
    done line's median leaves out, are left out here too); ``warm-up`` for a window of none."""
    if "steady_tokens_per_s" not in r:  # a record without it: the whole window
        return f"{si(r['tokens_per_s'])} tok/s"
    return "warm-up" if r["steady_tokens_per_s"] is None else f"{si(r['steady_tokens_per_s'])} tok/s"


# said once when a job's progress starts: which tokens/s each figure is
PROGRESS_LEGEND = ("tok/s while training: the steady steps since the previous line (warm-up steps left out); "
                   "done: the median of all the steady steps")


def step_line(r: dict[str, Any], width: int, gpu: list[str] | None = None) -> str:
    """The log point as one line of at most ``width`` characters: step, loss, tokens/s,
    MFU (or the data wait where MFU is n/a) and memory always; then, while they fit, the
    GPU's figures, the data wait, the step time, the learning rate, the gradient norm."""
    wait = data_figure(r)
    parts = [f"step {r['step']}/{r['max_steps']}", f"loss {r['loss']:.3f}", window_figure(r),
             f"MFU {percent(100 * r['mfu'])}" if r.get("mfu") is not None else wait]
    if r.get("peak_mem_mib") is not None:
        parts.append(f"mem {mib(r['peak_mem_mib'])}")
    extras = [*(gpu or []), *([wait] if r.get("mfu") is not None else []), f"{r['step_time_ms']:.1f} ms/step",
              f"lr {r['lr']:.2e}"]
    if r.get("grad_norm") is not None:
        extras.append(f"gnorm {r['grad_norm']:.2f}")
    if r.get("loss_scale") is not None:
        extras.append(f"scale {r['loss_scale']:g}")
    line = " ".join(parts)
    for extra in extras:  # in order of importance: stop at the first that does not fit
        if len(line) + 1 + len(extra) > width:
            break
        line += " " + extra
    return line


class ConsoleReporter:
    """Live progress for a person, or plain periodic lines for a log file; nothing off rank 0.

    The step line of a log point at which the monitor also samples waits for that sample
    (the loop hands it over right after), so the line carries this step's GPU figures."""

    def __init__(self, mode: str, max_steps: int, enabled: bool = True, console: Console | None = None,
                 monitor_every: int = 0) -> None:
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
        self.monitor_every = monitor_every
        self._held: dict[str, Any] | None = None  # a step record waiting for its monitor sample
        self._gpu: tuple[int, list[str]] = (-1, [])  # the latest sample's step and GPU figures
        self._slowdown: list[str] = []

    def __enter__(self) -> ConsoleReporter:
        if self.mode != "off":
            log.info(PROGRESS_LEGEND)
        if self.mode == "bar":
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[live]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False, refresh_per_second=PROGRESS_REFRESH_PER_S,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.max_steps, live="")
        return self

    def advance(self, step: int) -> None:
        self._flush()
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def train(self, record: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        self._flush()
        if self._progress is not None:
            n, steady = record.get("steady_steps_in_interval"), record.get("steady_tokens_per_s")
            figure = (f"{record['tokens_per_s']:,.0f} tok/s" if n is None else
                      f"{steady:,.0f} tok/s (last {n} steps)" if steady is not None else "warm-up")
            live = f"loss {record['loss']:.3f} | {figure}"
            self._progress.update(self._task, completed=record["step"], live=live)
        step = record["step"]
        if self.monitor_every and step % self.monitor_every == 0 and self._gpu[0] != step:
            self._held = record
        else:
            self._emit(record)

    def monitor(self, step: int, record: dict[str, Any], ranks: list[dict[str, Any]] | None = None) -> None:
        """Fold the sample's GPU figures into the step line; its host figures stay in metrics.jsonl."""
        if self.mode == "off":
            return
        self._gpu = (step, gpu_parts(record, ranks))
        if self._held is not None and self._held["step"] == step:
            self._flush()
        slowdown = sorted({r for row in (ranks or [record]) for r in row.get("throttle_reasons") or []
                           if r in SLOWDOWN_REASONS})  # not gpu_idle, nor a configured clock
        if slowdown != self._slowdown:
            self._slowdown = slowdown
            log.warning(f"step {step}: GPU clocks held down ({', '.join(slowdown)})" if slowdown
                        else f"step {step}: GPU clocks no longer held down")

    def line(self, text: str) -> None:
        if self.mode != "off":
            self._flush()
            log.info(text)

    def _emit(self, record: dict[str, Any]) -> None:
        log.info(step_line(record, self.console.width - TIME_WIDTH, self._gpu[1]))

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._emit(held)

    def __exit__(self, *exc: Any) -> None:
        self._flush()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
