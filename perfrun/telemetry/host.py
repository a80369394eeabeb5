"""Host telemetry (CPU, RSS, DataLoader workers) and host facts for gpu-check, via psutil.

CPU percentages are computed from CPU-time deltas between two calls, not from psutil's
``cpu_percent()``: that function keeps one hidden "last call" per process, which any
other caller (a progress bar, a library) would reset under us, and a delta of CPU
times is the exact mean over the interval rather than a point sample.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

_MIB = 1024 * 1024
_GIB = 1024**3

# Children that are not DataLoader workers: multiprocessing's helpers and inductor's
# compile workers. DataLoader workers are forked (same command line as the parent) or
# spawned via multiprocessing.spawn.
_NOT_WORKERS = ("resource_tracker", "semaphore_tracker", "forkserver", "compile_worker")


@dataclass
class HostInterval:
    """Means over one interval between two :meth:`HostSampler.interval` calls."""

    host_cpu_pct: float | None  # whole machine, 0..100
    proc_cpu_pct: float | None  # this process, 100 = one core busy
    workers: int  # DataLoader worker processes alive at the end of the interval
    workers_cpu_pct: float | None  # all workers together, 100 = one core busy


class HostSampler:
    """Reads this process's RSS (cheap, every sample) and CPU deltas (once per interval)."""

    def __init__(self, pid: int | None = None) -> None:
        self.proc = psutil.Process(pid or os.getpid())
        self._ncpu = psutil.cpu_count() or 1
        self._last_t = time.monotonic()
        self._last_sys = psutil.cpu_times()
        self._last_proc = self._proc_cpu()
        self._children: dict[int, tuple[psutil.Process, float]] = {}
        self._not_workers: set[int] = set()
        self._refresh_children(first=True)

    def rss_mib(self) -> float | None:
        try:
            return self.proc.memory_info().rss / _MIB
        except (psutil.Error, OSError):
            return None

    def _proc_cpu(self) -> float | None:
        try:
            t = self.proc.cpu_times()
            return t.user + t.system
        except (psutil.Error, OSError):
            return None

    def _is_worker(self, child: psutil.Process) -> bool:
        try:
            cmd = " ".join(child.cmdline())
        except (psutil.Error, OSError):
            return False
        return not any(tag in cmd for tag in _NOT_WORKERS)

    def _refresh_children(self, *, first: bool = False) -> float:
        """Update the worker list; return the CPU seconds the workers used since the last call.

        A worker first seen now was started during the interval (the list is refreshed
        every interval), so all its CPU time belongs to this interval; on the very first
        call there is no interval, so existing workers only set the baseline.
        """
        try:
            children = self.proc.children(recursive=False)
        except (psutil.Error, OSError):
            children = []
        used = 0.0
        seen: dict[int, tuple[psutil.Process, float]] = {}
        for child in children:
            known = self._children.get(child.pid)
            if known is None and (child.pid in self._not_workers or not self._is_worker(child)):
                self._not_workers.add(child.pid)
                continue
            proc = known[0] if known else child
            try:
                t = proc.cpu_times()
                total = t.user + t.system
            except (psutil.Error, OSError):
                continue
            before = known[1] if known else (total if first else 0.0)
            used += max(0.0, total - before)
            seen[child.pid] = (proc, total)
        self._children = seen
        return used

    def interval(self) -> HostInterval:
        """Mean CPU use since the previous call (or construction)."""
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-9)
        sys_now = psutil.cpu_times()
        host = _busy_pct(self._last_sys, sys_now)
        proc_now = self._proc_cpu()
        proc_pct = None
        if proc_now is not None and self._last_proc is not None:
            proc_pct = 100.0 * max(0.0, proc_now - self._last_proc) / dt
        workers_used = self._refresh_children()
        workers = len(self._children)
        self._last_t, self._last_sys, self._last_proc = now, sys_now, proc_now
        return HostInterval(
            host_cpu_pct=host,
            proc_cpu_pct=proc_pct,
            workers=workers,
            workers_cpu_pct=100.0 * workers_used / dt if workers else None,
        )


def _busy_pct(before: Any, after: Any) -> float | None:
    """psutil's own formula: busy = all - idle - iowait, over the delta of two cpu_times()."""

    def split(t: Any) -> tuple[float, float]:
        total = sum(t)
        idle = t.idle + getattr(t, "iowait", 0.0)
        # guest time is already counted in user/nice on Linux
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        return total, idle

    t0, i0 = split(before)
    t1, i1 = split(after)
    dt = t1 - t0
    if dt <= 0:
        return None
    return max(0.0, min(100.0, 100.0 * ((dt - (i1 - i0)) / dt)))


# -- facts for gpu-check -------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def disk_free_gib(path: str | os.PathLike[str]) -> tuple[float | None, float | None]:
    """(free, total) GiB of the filesystem holding ``path``."""
    try:
        du = shutil.disk_usage(path)
    except OSError:
        return None, None
    return du.free / _GIB, du.total / _GIB


def host_facts(output_dir: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """What gpu-check reports about the host: CPU, cores, RAM, disk where outputs go, /dev/shm."""
    vm = psutil.virtual_memory()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = psutil.cpu_count()
    free, total = disk_free_gib(output_dir)
    shm_free, shm_total = disk_free_gib("/dev/shm") if os.path.isdir("/dev/shm") else (None, None)
    return {
        "cpu_model": cpu_model(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "cpu_logical_cores": psutil.cpu_count(),
        "cpu_usable_cores": usable,
        "ram_total_gib": vm.total / _GIB,
        "ram_available_gib": vm.available / _GIB,
        "output_dir": str(Path(output_dir).resolve()),
        "disk_free_gib": free,
        "disk_total_gib": total,
        "shm_total_gib": shm_total,
        "shm_free_gib": shm_free,
        "platform": platform.platform(),
    }
