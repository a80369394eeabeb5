"""Did the job have the machine to itself, and did the GPU wait for its data?

Pure functions over figures the monitor and the loop already recorded, so each rule can be
checked on planted figures:

- :func:`assess`: the ``contended`` verdict of one job, with its evidence. A comparison
  between jobs (ladder, sweep, tune) must not rank a job that shared its machine: its
  tokens/s measure the neighbour as much as the knob.
- :func:`gpu_starved_pct`: the share of the step during which the GPU sat idle waiting for
  the next batch, from device-timed waits around the hand-off of each batch.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from typing import Any

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

    ``monitor``: :meth:`Monitor.summary` (host busy %, this process's and its workers' CPU,
    other GPU processes, interval step times); ``cpus``: the cores this process may use
    (default: its affinity).
    Contended when any of: other processes held CPU while the machine had no idle core to
    spare; another process computed on the same GPU; interval step times spread by more
    than :data:`STEP_SPREAD_FACTOR`. None of the figures: ``contended`` is None (unknown).
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
    known = others is not None or gpu_others is not None or spread is not None
    return {
        "contended": bool(evidence) if known else None,
        "evidence": evidence,
        "others_cpu_pct": None if others is None else round(others, 1),
        "idle_cpu_pct": None if idle is None else round(idle, 1),
        "proc_cpu_pct": proc,
        "cpus": cpus,
        "gpu_other_processes": gpu_others,
        "step_time_spread": None if spread is None else round(spread, 2),
        "rule": (f"contended when other processes used >= {OTHERS_CPU_PCT:.0f}% CPU while < {IDLE_CPU_PCT:.0f}% "
                 f"stayed idle, another process used the GPU, or interval step times spread > {STEP_SPREAD_FACTOR}x"),
    }


def say(verdict: dict[str, Any]) -> None:
    """The console line at the end of a job that did not have the machine to itself."""
    if verdict.get("contended"):
        log.warning("this job did not have the machine to itself: " + "; ".join(verdict["evidence"])
                    + " (its speed is not comparable with other jobs'; summary.json: contention)")


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
