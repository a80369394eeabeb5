"""Did the job have the machine to itself, and did the GPU wait for its data?

Pure functions over figures the monitor and the loop already recorded, so each rule can be
checked on planted figures:

- :func:`assess`: the ``contended`` verdict of one job, with its evidence. A comparison
  between jobs (ladder, sweep, tune) must not rank a job that shared its machine: its
  tokens/s measure the neighbour as much as the knob.
- :class:`LoadMeter`: the figures :func:`assess` needs where the monitor has none (its thread
  off, or a job that ended before the monitor's first interval, as a budgeted ladder job
  can): the machine's and this process's CPU time against the wall clock from the end of
  the warm-up to the end of the loop, and the interval step times at the log points, so
  that every job is assessed and none counts as quiet for want of a sample. A job whose
  host CPU could still not be read is "unknown" (``contended`` None): never counted.
- :func:`gpu_starved_pct`: the share of the step during which the GPU sat idle waiting for
  the next batch, from device-timed waits around the hand-off of each batch.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from perfrun.telemetry.host import HostSampler, HostSnapshot

log = logging.getLogger("perfrun")

#: Other processes used at least this much CPU (100 = one core busy) on average ...
OTHERS_CPU_PCT = 25.0
#: ... while the machine had less than this left idle (100 = one core): the job could not
#: get more CPU than it got, because someone else held it.
IDLE_CPU_PCT = 50.0
#: Interval step times whose 90th percentile exceeds the 10th by this factor are unsteady.
STEP_SPREAD_FACTOR = 2.0


def _step_spread(step_times_s: Sequence[float]) -> float | None:
    """p90 / p10 of the interval step times; None with fewer than 5 intervals."""
    times = sorted(t for t in step_times_s if t and t > 0)
    if len(times) < 5:
        return None
    deciles = statistics.quantiles(times, n=10)
    return deciles[-1] / deciles[0]


def usable_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def assess(monitor: dict[str, Any], cpus: int | None = None) -> dict[str, Any]:
    """The ``contention`` block of summary.json from the monitor's run figures.

    ``monitor``: :func:`job_figures` (the monitor's summary, completed by
    :meth:`LoadMeter.figures`: host busy %, this process's and its workers' CPU, other GPU
    processes, interval step times); ``cpus``: the cores this process may use (default: its
    affinity).
    Contended when any of: other processes held CPU while the machine had no idle core to
    spare; another process computed on the same GPU; interval step times spread by more
    than :data:`STEP_SPREAD_FACTOR`. Quiet only where the host's CPU was read and none of
    these holds; neither: ``contended`` is None (unknown).
    """
    cpus = cpus or usable_cpus()
    evidence: list[str] = []
    host, proc = monitor.get("host_cpu_pct_mean"), monitor.get("proc_cpu_pct_mean")
    others = idle = None
    if host is not None and proc is not None:
        total = host * cpus  # the machine's busy CPU, 100 = one core
        others = max(0.0, total - proc - (monitor.get("workers_cpu_pct_mean") or 0.0))
        idle = max(0.0, 100.0 * cpus - total)
        if others >= OTHERS_CPU_PCT and idle < IDLE_CPU_PCT:
            evidence.append(f"other processes used {others:.0f}% CPU (100% = one core) while {idle:.0f}% of "
                            f"{cpus} core(s) stayed idle; this job got {proc:.0f}%")
    gpu_others = monitor.get("gpu_other_processes_max")
    if gpu_others:
        evidence.append(f"{gpu_others} other process(es) computed on the same GPU")
    spread = _step_spread(monitor.get("interval_step_times_s") or [])
    if spread is not None and spread > STEP_SPREAD_FACTOR:
        evidence.append(f"step times spread {spread:.1f}x between the fastest and slowest tenth of the intervals")
    # a quiet job is one whose machine was measured: the host's CPU known (the step times or
    # an empty GPU alone cannot say that nothing else ran), or any evidence against it
    known = others is not None or bool(evidence)
    return {
        "contended": bool(evidence) if known else None,
        "evidence": evidence,
        **({} if known else {"unknown": "the host's CPU over the job could not be read (no figures from the monitor "
                                        "or the start and end of the loop): it is never counted"}),
        "others_cpu_pct": None if others is None else round(others, 1),
        "idle_cpu_pct": None if idle is None else round(idle, 1),
        "proc_cpu_pct": proc,
        "cpus": cpus,
        "gpu_other_processes": gpu_others,
        "step_time_spread": None if spread is None else round(spread, 2),
        "rule": (f"contended when other processes used >= {OTHERS_CPU_PCT:.0f}% CPU while < {IDLE_CPU_PCT:.0f}% "
                 f"stayed idle, another process used the GPU, or interval step times spread > {STEP_SPREAD_FACTOR}x"),
    }


class LoadMeter:
    """The host's CPU over the job's steady steps, and the interval step times, without a thread.

    Every job has one, the monitor's thread on or off. It reads the counters (the machine's
    /proc/stat, this process's and its DataLoader workers' CPU times: tens of microseconds)
    when the loop starts, when the warm-up ends and when the loop ends, so that a job shorter
    than the monitor's sampling period or its log interval (a budgeted job of a few steps) is
    judged all the same. Finding the workers scans /proc (about a millisecond): at the end
    of the warm-up, at the end, and, at the log points, at most every :data:`SCAN_PERIOD_S`.
    :meth:`figures` gives the keys :func:`assess` reads.
    """

    SCAN_PERIOD_S = 10.0

    def __init__(self) -> None:
        self.host = HostSampler()
        self._start = self.host.snapshot()
        self._steady: HostSnapshot | None = None  # counters when the warm-up ended
        self._end: HostSnapshot | None = None  # counters when the loop ended
        self._last_scan: float | None = None
        self._step_times: list[tuple[int, float]] = []  # (first step index, mean step time s)

    def start(self) -> None:
        """Counting starts with the loop (after setup and resume)."""
        self._start = self.host.snapshot()
        self._steady = self._end = None
        self._step_times = []

    def steady(self) -> None:
        """The warm-up just ended: the CPU figures cover the steps from here (a warm-up's
        compilation runs worker processes that would read as another process's CPU)."""
        self.host.scan_children()  # the DataLoader's workers have started by now
        self._steady = self.host.snapshot()

    def interval(self, first: int, done: int, step_time_s: float) -> None:
        """Steps ``first..done-1`` (local indices) just ended, ``step_time_s`` each on average."""
        now = time.monotonic()
        if self._last_scan is None or now - self._last_scan > self.SCAN_PERIOD_S:
            self.host.scan_children()
            self._last_scan = now
        self._step_times.append((first, step_time_s))

    def finish(self) -> None:
        """The loop ended: the last reading of the counters."""
        self.host.scan_children()
        self._end = self.host.snapshot()

    def figures(self, warmup: int, steady_steps: int) -> dict[str, Any]:
        """Means from the end of the warm-up (the loop's start where no step came after it:
        ``steady_steps`` 0) to the end of the loop: ``host_cpu_pct_mean``,
        ``proc_cpu_pct_mean``, ``workers_cpu_pct_mean``, and the steady
        ``interval_step_times_s`` of the log points, as the monitor's summary names them;
        empty before :meth:`finish`."""
        if self._end is None:
            return {}
        before = self._steady if self._steady is not None and steady_steps > 0 else self._start
        cpu = self.host.delta(before, self._end)
        return {"method": "CPU time against the wall clock from the end of the warm-up to the end of the loop",
                "window": "steady steps" if before is self._steady or warmup == 0 else "every step (none after the warm-up)",
                "window_s": round(self._end.t - before.t, 3),
                "host_cpu_pct_mean": _round(cpu.host_cpu_pct), "proc_cpu_pct_mean": _round(cpu.proc_cpu_pct),
                "workers_cpu_pct_mean": _round(cpu.workers_cpu_pct),
                "interval_step_times_s": [t for first, t in self._step_times if first >= warmup and t > 0]}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


#: the monitor's host CPU means, which stand only over its steady intervals
HOST_MEANS = ("host_cpu_pct_mean", "proc_cpu_pct_mean", "workers_cpu_pct_mean")


def job_figures(monitor: dict[str, Any] | None, load: dict[str, Any] | None) -> dict[str, Any]:
    """The figures :func:`assess` judges a job by: the monitor's where it has them, else the
    :class:`LoadMeter`'s (the end of the warm-up to the end of the loop). A job that ended
    before the monitor closed an interval after its warm-up (a budgeted ladder job) has only
    the latter: the monitor's means over warm-up intervals would count a compilation's
    worker processes as another process's CPU."""
    merged = dict(load or {})
    steady = (monitor or {}).get("host_cpu_window") == "steady intervals"
    merged.update({k: v for k, v in (monitor or {}).items()
                   if v is not None and v != [] and (steady or k not in HOST_MEANS)})
    return merged


def say(verdict: dict[str, Any]) -> None:
    """The console line at the end of a job that did not have the machine to itself, or of
    one where that is unknown."""
    if verdict.get("contended"):
        log.warning("this job did not have the machine to itself: " + "; ".join(verdict["evidence"])
                    + " (its speed is not comparable with other jobs'; summary.json: contention)")
    elif verdict.get("contended") is None:
        log.warning(f"whether this job had the machine to itself is unknown: {verdict.get('unknown', '')}")


def gpu_starved_pct(hand_off_waits_ms: Sequence[float], step_times_ms: Sequence[float]) -> float | None:
    """Share (%) of the steps' time that the GPU waited for its next batch.

    ``hand_off_waits_ms``: for each batch handed over, how long the compute stream waited on
    the device for that batch's copy to land (a CUDA event pair around the wait, read later
    without a sync); ``step_times_ms``: the same steps' durations. A wait of 0 means the batch
    was there before the GPU needed it. None when no step was timed.
    """
    total = sum(step_times_ms)
    if not step_times_ms or total <= 0:
        return None
    return 100.0 * min(sum(max(0.0, w) for w in hand_off_waits_ms), total) / total
