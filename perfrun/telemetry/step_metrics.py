"""Step timing, tokens/s and MFU.

On CUDA each step's end is a recorded event, so per-step times come from the device's
own timeline without a synchronisation per step; they are read (one synchronisation)
only when the loop asks for them at a log point. On the CPU, perf_counter is exact.
"""

from __future__ import annotations

import statistics
import time
from array import array
from dataclasses import dataclass

import torch


def now_mark(cuda: bool):
    """A point in time: a recorded CUDA event on the device's timeline, or perf_counter."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def seconds_between(a, b, cuda: bool) -> float:
    return a.elapsed_time(b) / 1000.0 if cuda else b - a


class StepTimer:
    """Per-step durations in seconds, collected lazily."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list = []  # CUDA events (or perf_counter floats) not yet turned into durations
        self._last = None
        self.durations: list[float] = []

    def start(self) -> None:
        """(Re)start timing: the next step is measured from here. Used after eval too."""
        self.flush()
        self._last = now_mark(self.cuda)

    def step_end(self) -> None:
        self._pending.append(now_mark(self.cuda))

    def flush(self) -> list[float]:
        """Turn pending marks into durations; returns the new ones."""
        if not self._pending:
            return []
        if self.cuda:
            self._pending[-1].synchronize()
        new, prev = [], self._last
        for mark in self._pending:
            new.append(seconds_between(prev, mark, self.cuda))
            prev = mark
        self._last = self._pending[-1]
        self._pending = []
        self.durations.extend(new)
        return new


@dataclass
class Throughput:
    """Turns step times into tokens/s and MFU; one source for the FLOPs and the peak.

    ``tokens_per_step`` counts every rank's tokens, so tokens/s is the total of the job;
    MFU is per device (the total divided by ``world`` against one device's peak), which is
    what the datasheet peak and gpu-check's measurement describe.
    """

    tokens_per_step: int
    flops_per_token: int
    peak_tflops: float | None  # None: MFU is not reported (reason in peak_source)
    peak_source: str
    world: int = 1

    def tokens_per_s(self, seconds: float, steps: int) -> float:
        return self.tokens_per_step * steps / seconds if seconds > 0 else 0.0

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_tflops:
            return None
        return self.flops_per_token * tokens_per_s / self.world / (self.peak_tflops * 1e12)


def median(values: list[float]) -> float | None:
    """statistics.median, or None where there is nothing to take it of."""
    return statistics.median(values) if values else None


PHASES = ("data", "forward", "backward", "optimizer")


class PhaseTimer:
    """Where a step's time goes: data (waiting for and copying the batch), forward,
    backward, optimizer (unscale, clip, step, schedule), summed over micro-steps.

    Marks are CUDA events on the GPU (the device's own timeline, no synchronisation until
    :meth:`flush`) and perf_counter on the CPU, like :class:`StepTimer`. Flushed figures
    are kept as one float array per phase (8 bytes per step and phase).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = None
        self._marks: list[tuple[str, object]] = []
        self._pending: list[tuple[object, list[tuple[str, object]]]] = []
        self.seconds: dict[str, array] = {p: array("d") for p in PHASES}

    def begin(self) -> None:
        self._start = now_mark(self.cuda)
        self._marks = []

    def mark(self, phase: str) -> None:
        """``phase`` just ended."""
        self._marks.append((phase, now_mark(self.cuda)))

    def end(self) -> None:
        self._pending.append((self._start, self._marks))
        self._marks = []

    def flush(self) -> None:
        if self.cuda and self._pending and self._pending[-1][1]:
            self._pending[-1][1][-1][1].synchronize()
        for start, marks in self._pending:
            out = dict.fromkeys(PHASES, 0.0)
            prev = start
            for phase, m in marks:
                out[phase] += seconds_between(prev, m, self.cuda)
                prev = m
            for p in PHASES:
                self.seconds[p].append(out[p])
        self._pending = []

    def summary(self, skip: int) -> dict[str, object]:
        """Median milliseconds per phase over the steps after ``skip``, and each one's share."""
        self.flush()
        if len(self.seconds["data"]) <= skip:
            return {}
        med = {p: median(list(self.seconds[p][skip:])) or 0.0 for p in PHASES}
        total = sum(med.values())
        return {
            "method": "CUDA events on the device timeline" if self.cuda else "time.perf_counter",
            "median_ms": {p: 1000 * v for p, v in med.items()},
            "share_pct": {p: (100 * v / total if total else None) for p, v in med.items()},
            "steps": len(self.seconds["data"]) - skip,
        }
