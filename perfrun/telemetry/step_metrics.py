"""Step metrics: step timing, tokens/s, MFU, peak memory and data wait, and the records
built from them (train, eval, monitor) and the end-of-job figures.

On CUDA each step's end is a recorded event, so per-step times come from the device's
own timeline without a synchronisation per step; they are read (one synchronisation)
only when the loop asks for them at a log point. On the CPU, perf_counter is exact.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from perfrun import distributed
from perfrun.config import MonitorConfig
from perfrun.summary import RunSummary
from perfrun.telemetry.contention import LoadMeter, gpu_starved_pct
from perfrun.telemetry.monitor import Monitor
from perfrun.telemetry.sinks import ConsoleReporter, RecordSink

log = logging.getLogger("perfrun")


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


class PeakMemory:
    """Peak memory: the CUDA allocator's peak on GPU, sampled process RSS on the CPU. One
    figure per log line; where it goes by category and module is
    :class:`perfrun.memory.tracker.CategoryTracker`'s, for one step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.source = "cuda_max_memory_allocated" if self.cuda else "process_rss_sampled_at_log_steps"
        self._proc = psutil.Process()
        self._peak = 0

    def reset(self) -> None:
        """Start counting from here (the loop's start, after setup and resume)."""
        self._peak = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mib(self) -> float:
        if self.cuda:
            self._peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._peak = max(self._peak, self._proc.memory_info().rss)
        return self._peak / 2**20


@dataclass
class MetricsConfig:
    """When the step metrics write: a train record every ``log_every`` steps and at the
    last, a monitor record every ``monitor_every`` (0: never); and which steps the
    summary's speed figures leave out."""

    log_every: int
    max_steps: int
    monitor_every: int
    warmup_steps: int  # steps kept out of the summary's speed figures


class StepMetrics:
    """Times every step and turns the times into the records and the summary's figures.

    Every rank measures; the sink and the console write on rank 0 only. Per step it costs
    a few list appends and (CUDA) recorded events; the synchronising reads happen at log
    points, before a checkpoint or an evaluation (:meth:`paused`) and at the end.
    """

    def __init__(self, device: torch.device, throughput: Throughput, config: MetricsConfig, sink: RecordSink,
                 reporter: ConsoleReporter, *, lr: Callable[[], float], loss_scale: Callable[[], float | None],
                 compiled: bool, gpu_waits: Callable[[], list[float] | None] = lambda: None,
                 handoffs_per_step: int = 1) -> None:
        self.throughput, self.config, self.sink, self.reporter = throughput, config, sink, reporter
        self.lr, self.loss_scale, self.compiled = lr, loss_scale, compiled
        # the device's wait for each prefetched batch copy, in ms (None: no copy prefetched)
        self.gpu_waits, self.handoffs_per_step = gpu_waits, handoffs_per_step
        self.gpu_wait_ms: list[float] | None = None
        self.timer, self.phases, self.memory = StepTimer(device), PhaseTimer(device), PeakMemory(device)
        self.monitor: Monitor | None = None
        self.load = LoadMeter()  # the host's CPU over the steady steps, whatever the monitor does
        self.host_wall: list[float] = []  # per step of this process, index = step - start_step - 1
        self.data_wait: list[float] = []
        self.loss_sum = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)  # the last step's, read at log points
        self.interval_start = 0  # local index where the current log interval starts
        self.start_step = self.start_tokens = self.tokens = 0
        self.train_time = 0.0
        self.last_train_loss: float | None = None
        self.last_val_loss: float | None = None
        self.first_step_s: float | None = None
        self._loop_t0 = self._step_t0 = 0.0
        self.untimed: set[int] = set()  # local indices of steps kept out of the speed figures (a tracked step)
        self.extra: RunSummary = {}  # figures other parts of the loop add to the summary (memory.breakdown)

    def start_monitor(self, cfg_monitor: MonitorConfig, device: torch.device, stack: ExitStack) -> None:
        """NVML and host sampling in a background thread, when ``monitor.every_n_steps`` > 0."""
        if self.config.monitor_every > 0:
            self.monitor = Monitor(device, cfg_monitor)
            self.monitor.start()
            stack.callback(self.monitor.close)

    def start(self, step: int) -> None:
        """The loop starts after ``step`` steps (a resumed run's, whose tokens
        :meth:`load_state_dict` gave)."""
        self.start_step, self.tokens = step, self.start_tokens
        self.memory.reset()
        self._loop_t0 = time.perf_counter()
        self.load.start()
        self.timer.start()

    def begin_step(self) -> None:
        self._step_t0 = time.perf_counter()
        self.phases.begin()

    def end_step(self) -> None:
        """The step's end on the device's timeline (before any hook runs)."""
        self.phases.end()
        self.timer.step_end()

    def record_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, data_wait: float) -> None:
        """Account one finished step: its loss (on the device: no sync), wall time, data wait."""
        self.loss_sum += loss
        self.grad_norm = grad_norm
        self.host_wall.append(time.perf_counter() - self._step_t0)
        self.data_wait.append(data_wait)
        if len(self.host_wall) == 1:
            self.timer.flush()
            self.first_step_s = time.perf_counter() - self._loop_t0
        if len(self.host_wall) == self.config.warmup_steps:
            self.load.steady()
        self.reporter.advance(step)

    def keep_out_of_speed(self, step: int) -> None:
        """Step ``step`` runs slower on purpose (under the memory tracker): no speed figure counts it."""
        self.untimed.add(step - self.start_step - 1)

    @property
    def tokens_done(self) -> int:
        """Tokens of every rank up to the last step, logged or not (for a checkpoint)."""
        return self.start_tokens + len(self.host_wall) * self.throughput.tokens_per_step

    def state_dict(self) -> int:
        """A checkpoint's count of tokens seen (every rank's), logged or not."""
        return self.tokens_done

    def load_state_dict(self, state_dict: int | None) -> None:
        """A resumed run counts on from the checkpoint's tokens (0 where an older file has none)."""
        self.start_tokens = int(state_dict or 0)

    def should_log(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.config.max_steps

    def log(self, step: int) -> None:
        """The train record of the interval since the last log point, to the sink and console."""
        self.timer.flush()
        self.phases.flush()
        done, first = len(self.host_wall), self.interval_start
        n = done - first
        interval_time = sum(self.timer.durations[first:done])
        interval_tokens = n * self.throughput.tokens_per_step
        self.train_time += interval_time
        self.tokens += interval_tokens
        tokens_per_s = self.throughput.tokens_per_s(interval_time, n)
        if self.monitor is None:  # the monitor's intervals have their own step times
            self.load.interval(first, done, interval_time / n)
        self.last_train_loss = distributed.mean_over_ranks(self.loss_sum).item() / n  # the global batch's loss
        wall = sum(self.host_wall[first:done])
        steady = self.timer.durations[max(first, self.config.warmup_steps):done]  # as the summary's median: no warm-up
        record = {
            "kind": "train", "step": step, "max_steps": self.config.max_steps, "loss": self.last_train_loss,
            "lr": self.lr(), "grad_norm": self.grad_norm.item(),
            "step_time_ms": 1000 * interval_time / n, "tokens_per_s": tokens_per_s,
            "steady_tokens_per_s": self.throughput.tokens_per_s(sum(steady), len(steady)) if steady else None,
            "steady_steps_in_interval": len(steady),
            "mfu": self.throughput.mfu(tokens_per_s),
            "host_data_wait_pct": 100 * sum(self.data_wait[first:done]) / wall if wall > 0 else 0.0,
            "gpu_starved_pct": self._gpu_starved_pct(first, done, interval_time),
            "peak_mem_mib": self.memory.peak_mib(), "interval_steps": n, "interval_tokens": interval_tokens,
            "interval_s": interval_time, "tokens": self.tokens, "elapsed_s": time.perf_counter() - self._loop_t0,
        }
        scale = self.loss_scale()
        if scale is not None:
            record["loss_scale"] = scale
        self.sink.write(record)
        self.reporter.train(record)
        self.loss_sum.zero_()
        self.interval_start = done

    def _gpu_starved_pct(self, first: int, done: int, seconds: float) -> float | None:
        """Percent of steps ``first..done-1``'s device time the GPU spent waiting for its
        batches (perfrun/data/handoff_timer.py; read after the timer's flush: the device has passed
        those steps); None off CUDA."""
        new = self.gpu_waits()
        if new is not None:
            self.gpu_wait_ms = (self.gpu_wait_ms or []) + new
        if self.gpu_wait_ms is None or seconds <= 0:
            return None
        k = self.handoffs_per_step
        return gpu_starved_pct(self.gpu_wait_ms[first * k:done * k], [1000 * seconds])

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluation and checkpoint saves stay out of the step times."""
        self.timer.flush()
        yield
        self.timer.start()

    def log_eval(self, step: int, val_loss: float | None) -> None:
        self.last_val_loss = val_loss
        self.sink.write({"kind": "eval", "step": step, "val_loss": val_loss})
        if val_loss is not None:
            self.reporter.line(f"step {step}: val loss {val_loss:.4f}")

    def should_sample(self, step: int) -> bool:
        return self.monitor is not None and step % self.config.monitor_every == 0

    def sample(self, step: int) -> None:
        """The monitor's record of the interval: every rank's GPU and host figures, in rank 0's log."""
        stats = self.monitor.collect(step, None)  # step times attached at the end: no sync here
        ranks = every_rank(stats)
        self.sink.write({"kind": "monitor", "step": step, **stats, **({"ranks": ranks} if ranks else {})})
        self.reporter.monitor(step, stats, ranks)

    def summary(self, step: int) -> RunSummary:
        """The job's figures: medians over the steady steps (after ``warmup_steps``)."""
        self.load.finish()
        self.timer.flush()
        warmup, durations = self.config.warmup_steps, self.timer.durations
        steady = [d for i, d in enumerate(durations) if i >= warmup and i not in self.untimed]
        steady_wall = [w for i, w in enumerate(self.host_wall) if i >= warmup and i not in self.untimed]
        if not steady:
            log.warning(f"no steady-state steps: all {len(durations)} steps ran within timing_warmup_steps={warmup}, "
                        "so the summary has no tokens/s or MFU; raise max_steps or lower timing_warmup_steps")
        med = median(steady)
        throughput = self.throughput
        tokens_per_s = throughput.tokens_per_step / med if med else None  # rank 0's step time; all ranks' tokens
        result: RunSummary = {
            "steps": step, "start_step": self.start_step, "tokens": self.tokens, "train_time_s": self.train_time,
            "first_step_s": self.first_step_s, "step_time_ms_median": 1000 * med if med else None,
            "steady_steps": len(steady), "tokens_per_s_median": tokens_per_s,
            "tokens_per_s_mean": throughput.tokens_per_s(sum(steady), len(steady)) if steady else None,
            "tokens_per_s_per_rank_median": tokens_per_s / throughput.world if tokens_per_s else None,
            "world_size": throughput.world, "mfu_median": throughput.mfu(tokens_per_s) if tokens_per_s else None,
            "peak_mem_mib": self.memory.peak_mib(), "peak_mem_source": self.memory.source,
            "host_data_wait_pct": (100 * sum(w for i, w in enumerate(self.data_wait) if i >= warmup and i not in self.untimed)
                                   / sum(steady_wall)
                              if steady_wall and sum(steady_wall) > 0 else None),
            "gpu_starved_pct": self._gpu_starved_pct(warmup, len(durations), sum(steady)),
            "compile_s_estimate": (self.first_step_s - med) if (self.compiled and self.first_step_s and med) else None,
            "final_train_loss": self.last_train_loss, "final_val_loss": self.last_val_loss,
            "step_breakdown": self.phases.summary(warmup),
        }
        if self.monitor is not None:
            result.update(self._monitor_summary())
        result["host_load"] = self.load.figures(warmup, len(steady))
        result.update(self.extra)
        return result

    def _monitor_summary(self) -> RunSummary:
        """This rank's energy over this rank's tokens; the job's is summed over ranks."""
        self.monitor.attach_step_times(self.start_step + 1, self.timer.durations, warmup=self.config.warmup_steps)
        self.monitor.close()
        tokens = self.tokens - self.start_tokens
        out: RunSummary = {"monitor": self.monitor.summary(tokens // self.throughput.world)}
        ranks = every_rank(out["monitor"])
        if ranks:
            out["monitor_ranks"] = ranks
            out["monitor_job"] = job_energy(ranks, tokens)
        return out


def every_rank(stats: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Under several ranks: each rank's ``stats`` tagged with its rank and host, gathered
    to rank 0 over the host (gloo) group, so no GPU waits; None on other ranks and alone."""
    if distributed.world_size() == 1:
        return None
    return distributed.gather_to_rank0({"rank": distributed.rank(), "host": socket.gethostname(), **stats})


def job_energy(ranks: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The whole job's energy: every rank's GPU, over every rank's tokens."""
    def total(key: str) -> float | None:  # None unless every rank measured it
        values = [r.get(key) for r in ranks]
        return None if any(v is None for v in values) else sum(values)

    energy = total("energy_j")
    return {"energy_j": energy, "joules_per_token": energy / tokens if energy is not None and tokens > 0 else None,
            "power_w_mean_sum": total("power_w_mean"), "ranks": len(ranks)}
