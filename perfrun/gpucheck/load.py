"""Was the machine busy while gpu-check measured? A peak measured beside other work is the
neighbour's as much as the machine's: it is reported as a warning with what was running,
never as ok.

:class:`LoadWatch` reads the CPU time every other process used over a window (all of the
machine's busy time less this process's own) and the processes that used the most, and on
a GPU the utilisation NVML saw and the processes on it. No thread: two readings, one at
each end.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

from perfrun.telemetry.contention import IDLE_CPU_PCT, OTHERS_CPU_PCT

#: How long gpu-check watches the machine before it measures.
BEFORE_S = 0.5
#: GPU utilisation (%) by others before the measurement that makes it busy.
GPU_BUSY_PCT = 10.0


class LoadWatch:
    """Other processes' CPU use between ``__enter__`` and ``__exit__``: ``result``."""

    def __init__(self, what: str, nvml: Any = None, nvml_handle: Any = None) -> None:
        self.what, self.nvml, self.handle = what, nvml, nvml_handle
        self.result: dict[str, Any] = {}
        self._me = psutil.Process()

    def __enter__(self) -> LoadWatch:
        self._procs = {}
        for p in psutil.process_iter(["name"]):
            try:
                p.cpu_percent(None)  # primes each process's own counter
                self._procs[p.pid] = p
            except (psutil.Error, OSError):
                continue
        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_s(), _own_s(self._me)
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-6)
        others = max(_busy_s() - self._busy0 - (_own_s(self._me) - self._own0), 0.0)
        cores = psutil.cpu_count() or os.cpu_count() or 1
        others_pct = 100 * others / wall
        idle_pct = 100 * cores - 100 * (_busy_s() - self._busy0) / wall
        top = []
        for pid, p in self._procs.items():
            if pid == os.getpid():
                continue
            try:
                pct = p.cpu_percent(None)
                if pct >= 5.0:
                    top.append((pct, f"{p.info.get('name') or '?'} (pid {pid}) {pct:.0f}%"))
            except (psutil.Error, OSError):
                continue
        self.result = {"window": self.what, "seconds": round(wall, 2), "others_cpu_pct": round(others_pct, 1),
                       "idle_cpu_pct": round(max(idle_pct, 0.0), 1), "cores": cores,
                       "top": [t for _, t in sorted(top, reverse=True)]}  # every process over 5%, busiest first
        gpu = _gpu_load(self.nvml, self.handle)
        if gpu:
            self.result.update(gpu)
        self.result["busy"] = busy(self.result)


def busy(load: dict[str, Any]) -> bool:
    """Others held CPU the measurement could have used, or were on the GPU."""
    cpu = load.get("others_cpu_pct", 0.0) >= OTHERS_CPU_PCT and load.get("idle_cpu_pct", 100.0) < IDLE_CPU_PCT
    return bool(cpu or load.get("gpu_processes") or (load.get("gpu_util_pct") or 0) >= GPU_BUSY_PCT)


def before(nvml: Any = None, nvml_handle: Any = None) -> dict[str, Any]:
    """The machine's load over :data:`BEFORE_S` seconds, before anything is measured."""
    with LoadWatch("before", nvml, nvml_handle) as watch:
        time.sleep(BEFORE_S)
    return watch.result


def described(loads: list[dict[str, Any]]) -> str:
    """``before: other processes used 150% CPU (python (pid 12) 98%, ...)`` for the busy windows."""
    parts = []
    for load in (x for x in loads if x.get("busy")):
        what = f"other processes used {load['others_cpu_pct']:.0f}% CPU (100% = one core)"
        if load.get("top"):
            what += f": {', '.join(load['top'][:5])}"
        if load.get("gpu_processes"):
            what += f"; on the GPU: {', '.join(load['gpu_processes'])}"
        parts.append(f"{load['window']}: {what}")
    return "; ".join(parts)


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_s(me: psutil.Process) -> float:
    t = me.cpu_times()
    return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)


def _gpu_load(nvml: Any, handle: Any) -> dict[str, Any]:
    """NVML's utilisation and the other processes on the GPU; {} without NVML."""
    if nvml is None or handle is None:
        return {}
    rates = nvml.call("gpu_util", "nvmlDeviceGetUtilizationRates", handle, warn=False)
    procs = nvml.call("gpu_processes", "nvmlDeviceGetComputeRunningProcesses", handle, warn=False) or []
    mine = os.getpid()
    out: dict[str, Any] = {"gpu_processes": [f"pid {p.pid} ({(getattr(p, 'usedGpuMemory', 0) or 0) / 2**20:,.0f} MiB)"
                                             for p in procs if getattr(p, "pid", mine) != mine]}
    if rates is not None:
        out["gpu_util_pct"] = float(rates.gpu)
    return out
