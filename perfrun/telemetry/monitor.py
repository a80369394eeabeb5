"""The training monitor: a background sampler of NVML and host figures, aggregated per interval.

Why a background thread: a value read at a step boundary (after a synchronise) sees
the GPU at its least busy; sampling every ``sample_interval_s`` and reporting mean and
max over the interval shows what the GPU did *during* the steps. NVML calls go
through ctypes, which releases the GIL, so the thread costs the training loop little;
its cost is measured anyway (``monitor_overhead_s`` in the summary).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from perfrun.config import MonitorConfig
from perfrun.telemetry import nvml as nvml_mod
from perfrun.telemetry.aggregate import (
    SLOW_STEP_FACTOR,
    IntervalRecord,
    Sample,
    Window,
    gpu_interval_record,
    gpu_run_figures,
    rounded,
    rounded_sig,
    throttle_slow_steps,
)
from perfrun.telemetry.host import HostInterval, HostSampler

#: Reads that block for milliseconds (NVML's energy counter, the /proc scan for worker
#: processes) happen in the sampler thread at most this often, never on the training thread
#: while the sampler runs.
SLOW_READ_PERIOD_S = 1.0


class Monitor:
    """Samples the run's GPU (via NVML) and the host in a background thread.

    The trainer calls :meth:`start`, then :meth:`collect` every ``every_n_steps`` steps,
    :meth:`summary` at the end and :meth:`close` (idempotent) in a ``finally``.
    On a CPU device only host figures are sampled and GPU keys are left out of
    :meth:`collect`'s record (they are ``None`` in :meth:`summary`).
    """

    def __init__(self, device: torch.device, cfg_monitor: MonitorConfig, *, nvml_module: Any = None) -> None:
        t0 = time.perf_counter()
        self.device = torch.device(device)
        self.interval_s = max(float(cfg_monitor.sample_interval_s), 0.01)
        self.pcie = bool(getattr(cfg_monitor, "pcie", False))
        self.is_cuda = self.device.type == "cuda"
        self.host = HostSampler()

        self.nvml: nvml_mod.Nvml | None = None
        self.gpu: nvml_mod.NvmlDevice | None = None
        self.mem_total_mib: float | None = None
        self.power_limit_w: float | None = None
        if self.is_cuda:
            self.nvml = nvml_mod.get_session(nvml_module)
            index = self.device.index
            if index is None:
                index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self.gpu = self.nvml.match_torch_device(index)
            if self.gpu is not None:
                _, self.mem_total_mib = self.nvml.memory_mib(self.gpu.handle)
                self.power_limit_w = self._power_limit()

        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._prev: Sample | None = None
        self._interval = Window()
        self._run = Window()
        self._records: list[IntervalRecord] = []
        self._last_step: int | None = None
        self._run_t0 = time.perf_counter()
        self._host_prev = self.host.snapshot()  # host counters at the previous collect
        self._host_latest = self._host_prev  # the sampler thread's latest reading
        self._host_carry: HostInterval | None = None
        self._gpu_others: int | None = None  # the most other processes seen on the GPU
        self._workers_max = 0

        self._energy_start_mj = self._energy_mj()
        self._energy_last_mj = self._energy_start_mj  # counter at the previous collect
        self._energy_latest_mj = self._energy_start_mj  # the sampler thread's latest reading
        self._last_slow_read = time.perf_counter()

        self.sampler_cpu_s = 0.0
        self.sampler_wall_s = 0.0
        self.collect_s = 0.0
        self.setup_s = time.perf_counter() - t0

    # -- reading ----------------------------------------------------------------------

    def _power_limit(self) -> float | None:
        assert self.nvml is not None and self.gpu is not None
        mw = self.nvml.call("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", self.gpu.handle)
        return None if mw is None else mw / 1000.0

    def _energy_mj(self) -> float | None:
        if self.nvml is None or self.gpu is None:
            return None
        v = self.nvml.call("energy_j", "nvmlDeviceGetTotalEnergyConsumption", self.gpu.handle)
        return None if v is None else float(v)

    def sample(self) -> Sample:
        """Take one sample now and add it to the current interval (the thread calls this)."""
        s = Sample(t=time.perf_counter(), rss_mib=self.host.rss_mib())
        if self.nvml is not None and self.gpu is not None:
            n, h, m = self.nvml, self.gpu.handle, self.nvml.module
            util = n.call("gpu_util_pct", "nvmlDeviceGetUtilizationRates", h)
            if util is not None:
                s.gpu_util, s.gpu_mem_util = float(util.gpu), float(util.memory)
            s.gpu_mem_used, _ = n.memory_mib(h)
            mw = n.call("power_w", "nvmlDeviceGetPowerUsage", h)
            s.power_w = None if mw is None else mw / 1000.0
            s.temp_c = _num(n.call("temp_c", "nvmlDeviceGetTemperature", h, getattr(m, "NVML_TEMPERATURE_GPU", 0)))
            s.sm_clock = _num(n.call("sm_clock_mhz", "nvmlDeviceGetClockInfo", h, getattr(m, "NVML_CLOCK_SM", 1)))
            s.mem_clock = _num(n.call("mem_clock_mhz", "nvmlDeviceGetClockInfo", h, getattr(m, "NVML_CLOCK_MEM", 2)))
            s.reasons = n.throttle_reasons(h)
            if self.pcie:  # NVML counts the bytes over a 20 ms window per call (its docs), GIL released
                tx = n.call("pcie_tx", "nvmlDeviceGetPcieThroughput", h, getattr(m, "NVML_PCIE_UTIL_TX_BYTES", 0))
                rx = n.call("pcie_rx", "nvmlDeviceGetPcieThroughput", h, getattr(m, "NVML_PCIE_UTIL_RX_BYTES", 1))
                s.pcie_tx = None if tx is None else tx / 1000.0  # KB/s -> MB/s
                s.pcie_rx = None if rx is None else rx / 1000.0
        with self._lock:
            self._interval.add(s, self._prev)
            self._run.add(s, self._prev)
            self._prev = s
        return s

    def _slow_reads(self) -> None:
        """The blocking reads, kept off the training thread (see SLOW_READ_PERIOD_S)."""
        self.host.scan_children()
        if self.nvml is not None and self.gpu is not None:
            others = self.nvml.other_processes(self.gpu.handle, {self.host.proc.pid, *self.host.worker_pids()})
            if others is not None:
                self._gpu_others = max(others, self._gpu_others or 0)
        mj = self._energy_mj()
        if mj is not None:
            self._energy_latest_mj = mj

    @property
    def sampling(self) -> bool:
        """Whether the background thread is running (else collect() reads everything itself)."""
        return self._thread is not None and self._thread.is_alive()

    # -- thread -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the daemon sampler thread (once; a closed monitor stays closed)."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._loop, name="perfrun-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                self.sample()
                self._host_latest = self.host.snapshot()
                if w0 - self._last_slow_read >= SLOW_READ_PERIOD_S:
                    self._last_slow_read = w0
                    self._slow_reads()
            except Exception as exc:  # noqa: BLE001 - telemetry must never kill training
                nvml_mod.warn_once("monitor:sample", f"monitor sample failed ({type(exc).__name__}: {exc}); continuing")
            w1 = time.perf_counter()
            self.sampler_cpu_s += time.thread_time() - c0
            self.sampler_wall_s += w1 - w0
            next_t += self.interval_s
            if next_t < w1:  # fell behind (a blocking PCIe read): don't burst to catch up
                next_t = w1
            self._stop.wait(next_t - w1)

    def close(self) -> None:
        """Stop the thread. Idempotent. NVML stays initialised: others may use it."""
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=max(2.0, 3 * self.interval_s))

    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reporting ----------------------------------------------------------------------

    def collect(self, step: int, step_time_s: float | None) -> dict[str, Any]:
        """Mean/max over the samples since the last collect, as flat JSON-able keys.

        ``step_time_s``: the trainer's mean step time over the same interval (``None``
        for warm-up), kept so :meth:`summary` can link slow steps to throttling.

        While the sampler thread runs, collect reads nothing itself (every_n_steps=1 must
        stay cheap): GPU figures, host CPU counters and energy come from the thread, so
        interval boundaries are accurate to one sample period. If no sample fell in the
        interval (collect called faster than the sample period), the latest sample is
        reported with ``monitor_samples: 0``. Without the thread, collect takes a sample.
        """
        t0 = time.perf_counter()
        sampling = self.sampling
        with self._lock:
            empty = self._interval.samples == 0
        if empty and not sampling:
            self.sample()
        with self._lock:
            w, self._interval = self._interval, Window()
            last = self._prev
        n_samples = w.samples
        if n_samples == 0 and last is not None:
            # an interval shorter than the sample period: report the latest sample (at
            # most sample_interval_s old) rather than pay for a reading on this thread
            w = Window()
            w.add(last, None)
        hi, dt = self._host_interval(sampling)

        out: dict[str, Any] = {"monitor_samples": n_samples}
        if self.is_cuda:
            out.update(self._gpu_record(w))
        out["host_cpu_pct_mean"] = rounded(hi.host_cpu_pct)
        out["proc_cpu_pct_mean"] = rounded(hi.proc_cpu_pct)
        out["rss_mib_max"] = rounded(w.agg("rss_mib").max)
        out["workers"] = hi.workers
        out["workers_cpu_pct_mean"] = rounded(hi.workers_cpu_pct)

        weighted = {key: (value * dt, dt) for key, value in (("host_cpu_pct", hi.host_cpu_pct),
                                                             ("proc_cpu_pct", hi.proc_cpu_pct),
                                                             ("workers_cpu_pct", hi.workers_cpu_pct))
                    if value is not None and dt > 0}
        self._workers_max = max(self._workers_max, hi.workers)
        self._records.append(
            IntervalRecord(
                since_step=self._last_step,
                step=step,
                step_time_s=step_time_s,
                slowdown_reasons=set(w.slowdown_reasons),
                host_weighted=weighted,
            )
        )
        self._last_step = step
        self.collect_s += time.perf_counter() - t0
        return out

    def _host_interval(self, sampling: bool) -> tuple[HostInterval, float]:
        """Host means since the previous collect, from the thread's latest counters.

        Returns the interval and its length in seconds (0 when carried over: no new
        reading since the previous collect, so that interval's figures are repeated).
        """
        if sampling:
            cur = self._host_latest
        else:
            self.host.scan_children()
            cur = self._host_latest = self.host.snapshot()
        if cur is self._host_prev or cur.t <= self._host_prev.t:
            carry = self._host_carry or HostInterval(None, None, len(cur.worker_cpu_s), None)
            return carry, 0.0
        hi = self.host.delta(self._host_prev, cur)
        dt = cur.t - self._host_prev.t
        self._host_prev, self._host_carry = cur, hi
        return hi, dt

    def _gpu_record(self, w: Window) -> dict[str, Any]:
        # Without the thread, collect reads the total-energy counter itself: the interval's
        # energy is its exact delta. With the thread, the counter is read only about once
        # a second, so a short interval may see no new reading (a false 0 J): its energy
        # is then the integral of its power samples, and the counter still gives the
        # run's exact total in summary() (energy_source says which was used).
        energy_j: float | None = None
        if self.sampling:
            energy_j = w.integrated_energy_j()
            now_mj = self._energy_latest_mj
        else:
            now_mj = self._energy_mj()
            if now_mj is not None and self._energy_last_mj is not None:
                energy_j = (now_mj - self._energy_last_mj) / 1000.0
            elif self._energy_start_mj is None:
                energy_j = w.integrated_energy_j()
        if now_mj is not None:
            self._energy_last_mj = now_mj
        return gpu_interval_record(w, mem_total_mib=self.mem_total_mib, power_limit_w=self.power_limit_w,
                                   energy_j=energy_j, pcie=self.pcie)

    def attach_step_times(self, first_step: int, durations: list[float], warmup: int = 0) -> None:
        """Fill in each interval's mean step time from the trainer's per-step durations
        (``durations[i]`` is step ``first_step + i``), for intervals collected without one.
        Intervals that hold any of the first ``warmup`` steps (compilation, allocator
        warm-up) get none, so they are never called slow.

        The trainer hands them over at the end rather than at every collect: reading CUDA
        step times at each collect would synchronise the device every ``every_n_steps``.
        """
        for r in self._records:
            if r.step_time_s is None:
                lo = (r.since_step or first_step - 1) - first_step + 1
                if lo < warmup:
                    continue
                span = durations[lo:max(lo, r.step - first_step + 1)]
                r.step_time_s = sum(span) / len(span) if span else None

    def throttle_slow_steps(self) -> list[dict[str, Any]]:
        """The intervals collected so far that were slow while the GPU reported a
        slowdown reason (the rule: :func:`aggregate.throttle_slow_steps`)."""
        return throttle_slow_steps(self._records)

    def summary(self, tokens: int) -> dict[str, Any]:
        """Run-level figures for summary.json.

        ``tokens``: every token processed while the monitor ran (warm-up included),
        because ``energy_j`` covers that whole span; ``joules_per_token`` divides them.
        """
        with self._lock:
            run = self._run
            energy_j: float | None = None
            source: str | None = None
            now_mj = self._energy_mj()
            if now_mj is not None and self._energy_start_mj is not None:
                energy_j, source = (now_mj - self._energy_start_mj) / 1000.0, "nvml_total_energy_counter"
            elif self.gpu is not None and run.integrated_energy_j() is not None:
                energy_j, source = run.integrated_energy_j(), "power_samples_integrated"
            hw = self._host_means()
            out: dict[str, Any] = {
                "gpu_name": self.gpu.name if self.gpu else None,
                "gpu_uuid": self.gpu.uuid if self.gpu else None,
                **gpu_run_figures(run, mem_total_mib=self.mem_total_mib, power_limit_w=self.power_limit_w),
                "energy_j": rounded(energy_j, 2),
                "energy_source": source,
                "joules_per_token": (energy_j / tokens) if (energy_j is not None and tokens > 0) else None,
                "throttle_reasons_seen": sorted(run.reasons_seen) if run.reason_samples else None,
                "throttled_sample_share": rounded(run.throttled_share(), 3),
                "throttle_slow_steps": self.throttle_slow_steps(),
                "throttle_slow_step_rule": (
                    f"interval step time > {SLOW_STEP_FACTOR:.2f} x median while a slowdown reason was reported"
                ),
                **{f"{k}_mean": hw[k] for k in ("host_cpu_pct", "proc_cpu_pct")},
                "host_cpu_window": self._host_window(),
                "gpu_other_processes_max": self._gpu_others,
                "interval_step_times_s": [rounded_sig(r.step_time_s) for r in self._records if r.step_time_s],
                "rss_mib_max": rounded(run.agg("rss_mib").max),
                "workers_max": self._workers_max,
                "workers_cpu_pct_mean": hw["workers_cpu_pct"],
                "monitor_samples": run.samples,
                "monitor_sample_interval_s": self.interval_s,
                "monitor_wall_s": round(time.perf_counter() - self._run_t0, 3),
                # the monitor's own costs, to 4 significant figures: microseconds stay > 0
                "monitor_setup_s": rounded_sig(self.setup_s),
                "monitor_sampler_cpu_s": rounded_sig(self.sampler_cpu_s),
                "monitor_sampler_wall_s": rounded_sig(self.sampler_wall_s),
                "monitor_collect_s": rounded_sig(self.collect_s),
                "monitor_overhead_s": rounded_sig(self.sampler_cpu_s + self.collect_s),
            }
        return out


    def _steady(self) -> list[IntervalRecord]:
        """The intervals the run's host CPU means cover: those with a step time (the warm-up's
        compilation, with its compile-worker processes, would read as another process's CPU),
        or every interval where none has one yet."""
        steady = [r for r in self._records if r.step_time_s is not None]
        return steady or self._records

    def _host_window(self) -> str:
        return "steady intervals" if any(r.step_time_s is not None for r in self._records) else "all intervals"

    def _host_means(self) -> dict[str, float | None]:
        """Time-weighted means of the host CPU figures over :meth:`_steady`'s intervals."""
        out: dict[str, float | None] = {}
        for key in ("host_cpu_pct", "proc_cpu_pct", "workers_cpu_pct"):
            parts = [r.host_weighted[key] for r in self._steady() if key in r.host_weighted]
            seconds = sum(dt for _, dt in parts)
            out[key] = rounded(sum(v for v, _ in parts) / seconds) if seconds else None
        return out


def _num(v: Any) -> float | None:
    return None if v is None else float(v)
