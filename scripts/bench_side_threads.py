#!/usr/bin/env python3
"""The CPU that perfrun's background threads take while a step runs: the progress bar's
drawing thread (rich, at perfrun's redraw rate and at rich's default) and the monitor's
sampler (monitor.sample_interval_s), each alone for --seconds while the main thread sleeps.

    python scripts/bench_side_threads.py [--seconds S]

Printed: milliseconds of process CPU time per second of wall time (time.process_time, all
threads). That time is taken on the same cores as the step's threads and, for Python work,
under the GIL the step's own Python waits for; on a 2-core machine with 2 torch threads it
lands on the step. CPU time moves much less with other load on the machine than wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.telemetry.monitor import Monitor  # noqa: E402
from perfrun.telemetry.sinks import PROGRESS_REFRESH_PER_S  # noqa: E402


def cpu_ms_per_s(seconds: float, body) -> float:
    c0, t0 = time.process_time(), time.perf_counter()
    body(seconds)
    return 1000 * (time.process_time() - c0) / (time.perf_counter() - t0)


def bar(refresh_per_s: float):
    """perfrun's progress bar (its columns, a terminal's width), advanced 10 times a second."""
    def body(seconds: float) -> None:
        console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
        p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[live]}"),
                     TimeElapsedColumn(), TimeRemainingColumn(), console=console, refresh_per_second=refresh_per_s)
        p.start()
        task = p.add_task("train", total=10**6, live="loss 4.123 | 12,345 tok/s")
        for i in range(int(seconds * 10)):
            time.sleep(0.1)
            p.update(task, completed=i)
        p.stop()
    return body


def monitor(interval_s: float):
    def body(seconds: float) -> None:
        m = Monitor(torch.device("cpu"), SimpleNamespace(every_n_steps=10, sample_interval_s=interval_s, pcie=False))
        m.start()
        time.sleep(seconds)
        m.close()
    return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    cases = [("nothing (the main thread sleeping)", lambda s: time.sleep(s)),
             ("progress bar, rich's default 10 redraws/s", bar(10)),
             (f"progress bar, perfrun's {PROGRESS_REFRESH_PER_S} redraws/s", bar(PROGRESS_REFRESH_PER_S)),
             ("monitor sampler, every 0.1 s (the default)", monitor(0.1))]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.seconds:g} s each")
    for name, body in cases:
        print(f"{name:<48} {cpu_ms_per_s(args.seconds, body):6.2f} ms CPU per s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
