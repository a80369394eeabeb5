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
import threading
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


@dataclass
class HostSnapshot:
    """Cumulative CPU counters at one instant; two of them make a :class:`HostInterval`."""

    t: float
    sys_times: Any  # psutil.cpu_times()
    proc_cpu_s: float | None  # this process, user + system
    worker_cpu_s: dict[int, float]  # known worker pid -> user + system


class HostSampler:
    """This process's RSS and CPU, the machine's CPU, and the DataLoader workers' CPU.

    Finding the workers means listing this process's children, which scans every pid in
    ``/proc`` (milliseconds on a busy host), so :meth:`scan_children` is separate; the
    monitor's thread calls it about once a second. :meth:`snapshot` reads only counters
    (a few /proc files); :func:`host_delta` turns two snapshots into interval means.
    """

    def __init__(self, pid: int | None = None) -> None:
        self.proc = psutil.Process(pid or os.getpid())
        self._lock = threading.Lock()
        self._workers: dict[int, psutil.Process] = {}
        # CPU seconds a worker had before perfrun first saw it (only for workers that
        # existed at construction; a worker found later started after the last scan)
        self._baseline: dict[int, float] = {}
        self._not_workers: set[int] = set()
        self.scan_children(first=True)
        self._last = self.snapshot()

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

    def scan_children(self, *, first: bool = False) -> None:
        """Find new worker processes and forget dead ones."""
        try:
            children = self.proc.children(recursive=False)
        except (psutil.Error, OSError):
            return
        alive = {c.pid for c in children}
        found: dict[int, psutil.Process] = {}
        for child in children:
            if child.pid in self._workers or child.pid in self._not_workers:
                continue
            if not self._is_worker(child):
                self._not_workers.add(child.pid)
                continue
            if first:
                try:
                    t = child.cpu_times()
                except (psutil.Error, OSError):
                    continue
                self._baseline[child.pid] = t.user + t.system
            found[child.pid] = child
        with self._lock:
            self._workers = {pid: w for pid, w in self._workers.items() if pid in alive}
            self._workers.update(found)
            self._not_workers &= alive

    def worker_pids(self) -> list[int]:
        with self._lock:
            return list(self._workers)

    def snapshot(self) -> HostSnapshot:
        """Current counters: machine CPU times, this process's, and each known worker's."""
        with self._lock:
            workers = list(self._workers.items())
        worker_cpu: dict[int, float] = {}
        for pid, proc in workers:
            try:
                t = proc.cpu_times()
            except (psutil.Error, OSError):  # exited: its last slice of CPU is lost
                continue
            worker_cpu[pid] = t.user + t.system
        return HostSnapshot(time.monotonic(), psutil.cpu_times(), self._proc_cpu(), worker_cpu)

    def delta(self, before: HostSnapshot, after: HostSnapshot) -> HostInterval:
        """Means over the time between two snapshots."""
        dt = max(after.t - before.t, 1e-9)
        proc_pct = None
        if after.proc_cpu_s is not None and before.proc_cpu_s is not None:
            proc_pct = 100.0 * max(0.0, after.proc_cpu_s - before.proc_cpu_s) / dt
        used = 0.0
        for pid, total in after.worker_cpu_s.items():
            start = before.worker_cpu_s.get(pid, self._baseline.get(pid, 0.0))
            used += max(0.0, total - start)
        workers = len(after.worker_cpu_s)
        return HostInterval(
            host_cpu_pct=_busy_pct(before.sys_times, after.sys_times),
            proc_cpu_pct=proc_pct,
            workers=workers,
            workers_cpu_pct=100.0 * used / dt if workers else None,
        )

    def interval(self, *, scan: bool = True) -> HostInterval:
        """Mean CPU use since the previous call (or construction); scans for workers first."""
        if scan:
            self.scan_children()
        now = self.snapshot()
        out = self.delta(self._last, now)
        self._last = now
        return out


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
