"""Step timing, tokens/s and MFU.

On CUDA each step's end is a recorded event, so per-step times come from the device's
own timeline without a synchronisation per step; they are read (one synchronisation)
only when the loop asks for them at a log point. On the CPU, perf_counter is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class StepTimer:
    """Per-step durations in seconds, collected lazily."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list = []  # CUDA events (or perf_counter floats) not yet turned into durations
        self._last = None
        self.durations: list[float] = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """(Re)start timing: the next step is measured from here. Used after eval too."""
        self.flush()
        self._last = self._mark()

    def step_end(self) -> None:
        self._pending.append(self._mark())

    def flush(self) -> list[float]:
        """Turn pending marks into durations; returns the new ones."""
        if not self._pending:
            return []
        if self.cuda:
            self._pending[-1].synchronize()
            new = []
            prev = self._last
            for ev in self._pending:
                new.append(prev.elapsed_time(ev) / 1000.0)
                prev = ev
        else:
            new, prev = [], self._last
            for t in self._pending:
                new.append(t - prev)
                prev = t
        self._last = self._pending[-1]
        self._pending = []
        self.durations.extend(new)
        return new


@dataclass
class Throughput:
    """Turns step times into tokens/s and MFU; one source for the FLOPs and the peak."""

    tokens_per_step: int
    flops_per_token: int
    peak_tflops: float | None  # None: MFU is not reported (reason in peak_source)
    peak_source: str
    steady: list[float] = field(default_factory=list)

    def tokens_per_s(self, seconds: float, steps: int) -> float:
        return self.tokens_per_step * steps / seconds if seconds > 0 else 0.0

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_tflops:
            return None
        return self.flops_per_token * tokens_per_s / (self.peak_tflops * 1e12)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
