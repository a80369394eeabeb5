"""The monitor's maths, apart from its thread: samples, their per-interval and per-run
aggregates (mean/max/min per field, throttled share, power integrated over time), the
interval record, and the rule that links slow steps to throttling.

Pure: nothing here reads NVML or the host, so each rule can be checked on planted samples.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from perfrun.telemetry.nvml import SLOWDOWN_REASONS

#: Steps slower than the run's median step time by more than this are "slow".
SLOW_STEP_FACTOR = 1.10
#: At most this many slow intervals are listed in the summary (the slowest first).
MAX_SLOW_STEPS_LISTED = 50

GPU_FIELDS = (
    "gpu_util",
    "gpu_mem_util",
    "gpu_mem_used",
    "power_w",
    "temp_c",
    "sm_clock",
    "mem_clock",
    "pcie_tx",
    "pcie_rx",
)


@dataclass
class Sample:
    """One reading of everything the sampler watches; ``None`` is N/A."""

    t: float
    rss_mib: float | None = None
    gpu_util: float | None = None
    gpu_mem_util: float | None = None
    gpu_mem_used: float | None = None  # MiB
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock: float | None = None
    mem_clock: float | None = None
    pcie_tx: float | None = None  # MB/s
    pcie_rx: float | None = None
    reasons: list[str] | None = None  # decoded clock-event reasons


@dataclass
class FieldStats:
    """Running count/sum/max/min of one field, skipping N/A."""

    n: int = 0
    total: float = 0.0
    hi: float = -math.inf
    lo: float = math.inf

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.n += 1
        self.total += v
        self.hi = max(self.hi, v)
        self.lo = min(self.lo, v)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def max(self) -> float | None:
        return self.hi if self.n else None

    @property
    def min(self) -> float | None:
        return self.lo if self.n else None


@dataclass
class Window:
    """Aggregates over a span of samples: one per interval, one for the whole run."""

    samples: int = 0
    aggs: dict[str, FieldStats] = field(default_factory=dict)
    reasons_seen: set[str] = field(default_factory=set)
    reason_samples: int = 0  # samples whose reasons could be read
    slowdown_samples: int = 0
    slowdown_reasons: set[str] = field(default_factory=set)
    power_integral_j: float = 0.0
    power_integral_ok: bool = True

    def agg(self, name: str) -> FieldStats:
        a = self.aggs.get(name)
        if a is None:
            a = self.aggs[name] = FieldStats()
        return a

    def add(self, s: Sample, prev: Sample | None) -> None:
        self.samples += 1
        self.agg("rss_mib").add(s.rss_mib)
        for name in GPU_FIELDS:
            self.agg(name).add(getattr(s, name))
        if s.reasons is not None:
            self.reason_samples += 1
            self.reasons_seen.update(s.reasons)
            slow = [r for r in s.reasons if r in SLOWDOWN_REASONS]
            if slow:
                self.slowdown_samples += 1
                self.slowdown_reasons.update(slow)
        if prev is not None and s.t > prev.t:
            if s.power_w is None or prev.power_w is None:
                self.power_integral_ok = False
            else:  # trapezoid: the fallback when the energy counter is N/A
                self.power_integral_j += 0.5 * (s.power_w + prev.power_w) * (s.t - prev.t)

    def throttled_share(self) -> float | None:
        return self.slowdown_samples / self.reason_samples if self.reason_samples else None

    def integrated_energy_j(self) -> float | None:
        """Power integrated over the window's samples; None where a power reading was N/A
        or fewer than two samples bound a span."""
        return self.power_integral_j if (self.power_integral_ok and self.samples > 1) else None


@dataclass
class IntervalRecord:
    """What the slow-step rule needs from one collect() interval."""

    since_step: int | None  # the previous collect's step (exclusive); None for the first
    step: int
    step_time_s: float | None
    slowdown_reasons: set[str]
    # host CPU figure -> (mean x seconds, seconds) over the interval: the run's means are
    # taken over the steady intervals only (those with a step time), see Monitor.summary
    host_weighted: dict[str, tuple[float, float]] = field(default_factory=dict)


def rounded(v: float | None, nd: int = 1) -> float | None:
    """A figure for metrics.jsonl and summary.json, to ``nd`` decimals."""
    return None if v is None else round(v, nd)


def rounded_sig(v: float, digits: int = 4) -> float:
    """A duration to ``digits`` significant figures: a cost of microseconds stays a
    positive number instead of rounding to 0.0."""
    return float(f"{v:.{digits}g}")


def throttle_slow_steps(records: list[IntervalRecord]) -> list[dict[str, Any]]:
    """Intervals that were slow while the GPU reported a slowdown reason.

    The rule, exactly: take every interval with a step time (``step_time_s`` not
    ``None``); the median of those step times is the run's median. An interval is listed
    when its step time is more than ``SLOW_STEP_FACTOR`` (1.10) times that median AND at
    least one sample taken during it reported a slowdown clock-event reason
    (:data:`nvml.SLOWDOWN_REASONS`: power cap, thermal or hardware slowdown, power brake,
    sync boost, board limit, reliability; not ``gpu_idle`` or a configured clock). Fewer
    than 3 timed intervals give no median worth comparing against, so nothing is listed.
    Listed slowest first, at most ``MAX_SLOW_STEPS_LISTED``; each entry covers the steps
    after ``since_step`` up to and including ``step``.
    """
    timed = [r for r in records if r.step_time_s is not None and r.step_time_s > 0]
    if len(timed) < 3:
        return []
    median = statistics.median(r.step_time_s for r in timed)  # type: ignore[misc]
    out = []
    for r in timed:
        assert r.step_time_s is not None
        if r.step_time_s > SLOW_STEP_FACTOR * median and r.slowdown_reasons:
            out.append(
                {
                    "step": r.step,
                    "since_step": r.since_step,
                    "step_time_s": round(r.step_time_s, 6),
                    "median_step_time_s": round(median, 6),
                    "slower_pct": round(100.0 * (r.step_time_s / median - 1.0), 1),
                    "reasons": sorted(r.slowdown_reasons),
                }
            )
    out.sort(key=lambda d: -d["step_time_s"])
    return out[:MAX_SLOW_STEPS_LISTED]


# (key, sampled field or None for a fixed figure, statistic, decimals) of each GPU figure
_INTERVAL_FIGURES = (
    ("gpu_util_pct_mean", "gpu_util", "mean", 1),
    ("gpu_util_pct_max", "gpu_util", "max", 1),
    ("gpu_mem_util_pct_mean", "gpu_mem_util", "mean", 1),
    ("gpu_mem_used_mib", "gpu_mem_used", "max", 0),
    ("gpu_mem_total_mib", None, "", 0),
    ("power_w_mean", "power_w", "mean", 1),
    ("power_w_max", "power_w", "max", 1),
    ("power_limit_w", None, "", 1),
    ("temp_c_mean", "temp_c", "mean", 1),
    ("temp_c_max", "temp_c", "max", 1),
    ("sm_clock_mhz_mean", "sm_clock", "mean", 0),
    ("sm_clock_mhz_min", "sm_clock", "min", 0),
    ("mem_clock_mhz_mean", "mem_clock", "mean", 0),
)
_RUN_FIGURES = (
    ("gpu_util_pct_mean", "gpu_util", "mean", 1),
    ("gpu_util_pct_max", "gpu_util", "max", 1),
    ("gpu_mem_used_mib_max", "gpu_mem_used", "max", 0),
    ("gpu_mem_total_mib", None, "", 0),
    ("power_w_mean", "power_w", "mean", 1),
    ("power_w_max", "power_w", "max", 1),
    ("power_limit_w", None, "", 1),
    ("temp_c_max", "temp_c", "max", 1),
    ("sm_clock_mhz_mean", "sm_clock", "mean", 0),
)


def _figures(w: Window, spec: tuple[tuple[str, str | None, str, int], ...], fixed: dict[str, float | None]) -> dict[str, Any]:
    return {key: rounded(fixed[key] if name is None else getattr(w.agg(name), stat), nd) for key, name, stat, nd in spec}


def gpu_interval_record(w: Window, *, mem_total_mib: float | None, power_limit_w: float | None,
                        energy_j: float | None, pcie: bool) -> dict[str, Any]:
    """One interval's GPU figures, as the flat keys of a ``kind: monitor`` record."""
    rec = _figures(w, _INTERVAL_FIGURES, {"gpu_mem_total_mib": mem_total_mib, "power_limit_w": power_limit_w})
    rec["throttle_reasons"] = sorted(w.reasons_seen) if w.reason_samples else None
    rec["throttled_sample_share"] = rounded(w.throttled_share(), 3)
    rec["energy_j"] = rounded(energy_j, 2)
    if pcie:
        rec["pcie_tx_mb_s_mean"] = rounded(w.agg("pcie_tx").mean)
        rec["pcie_rx_mb_s_mean"] = rounded(w.agg("pcie_rx").mean)
    return rec


def gpu_run_figures(run: Window, *, mem_total_mib: float | None, power_limit_w: float | None) -> dict[str, Any]:
    """The whole run's GPU figures for summary.json (energy apart: it needs the counter)."""
    return _figures(run, _RUN_FIGURES, {"gpu_mem_total_mib": mem_total_mib, "power_limit_w": power_limit_w})
