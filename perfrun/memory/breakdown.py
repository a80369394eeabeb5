"""``memory.breakdown=true``: where one step's memory goes, measured in the run.

:class:`TrackedStep` wraps the train step and decides its own cadence: the first step
after the warm-up runs under torch's memory tracker (:mod:`perfrun.memory.tracker`),
everything else passes through. The bytes of each category at that step's peak and the
ten modules holding most go to summary.json (``memory.breakdown``), metrics.jsonl and the
loggers (a ``memory`` record) and the log (one line); the peak measured the usual way
stands beside them: ``torch.cuda.max_memory_allocated`` on CUDA (with the allocator's
reserved-but-free bytes), and on the CPU the bytes live before the step plus the peak of
the allocations torch's profiler saw during it. The tracked step runs slower (every
operator is intercepted), so it is kept out of the speed figures.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from perfrun.environment import environment_default
from perfrun.memory.tracker import CATEGORIES, SHORT, Breakdown, CategoryTracker, tracker_missing
from perfrun.telemetry.sinks import RecordSink
from perfrun.telemetry.step_metrics import StepMetrics

log = logging.getLogger("perfrun")
WIDTH = 71  # the log line's message: 80 columns less the time stamp


def size(n: float) -> str:
    """Bytes in the shortest unit that keeps three figures: ``82M``, ``1.4G``, ``512K``."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}B"


def one_line(prefix: str, categories: dict[str, int], peak: int, width: int = WIDTH) -> str:
    """``prefix peak 82M = act 68M tmp 4.0M opt 6.6M par 3.3M``: the largest first, as many
    as fit in ``width``."""
    line = f"{prefix} peak {size(peak)} ="
    for name in sorted((c for c in CATEGORIES if categories.get(c)), key=lambda c: -categories[c]):
        part = f" {SHORT[name]} {size(categories[name])}"
        if len(line) + len(part) > width:
            break
        line += part
    return line


class TrackedStep:
    """The train step, with step ``warmup + 1`` of this run's steps run under the tracker."""

    def __init__(self, inner: Any, metrics: StepMetrics, sink: RecordSink, *, warmup: int, max_steps: int,
                 top: int = 10) -> None:
        self.inner, self.metrics, self.sink = inner, metrics, sink
        self.stream, self.device = inner.stream, inner.device
        self.warmup, self.max_steps, self.top = warmup, max_steps, top
        self.at: int | None = None
        self.result: dict[str, Any] | None = None

    def start(self) -> None:
        self.inner.start()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        if self.at is None:  # the first step of this run (a resumed run's too) sets the cadence
            self.at = step + self.warmup
            if self.at >= self.max_steps:
                self._store({"skipped": f"no step after the {self.warmup} warm-up steps but the last to spare "
                                        f"(max_steps={self.max_steps}); raise max_steps"})
        if step != self.at or self.result is not None:
            return self.inner(step)
        return self._tracked(step)

    def _tracked(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        self.metrics.keep_out_of_speed(step)
        plan, optimizer = self.inner.plan, self.inner.optimizer
        base = _live_bytes(plan.raw_model, optimizer)
        missing = tracker_missing()
        with _measured_peak(self.device) as measured:
            if missing is not None:
                out = self.inner(step)
                found = Breakdown({}, 0, method=f"peak only (no breakdown: {missing})", device=str(self.device))
            else:
                tracker = CategoryTracker(plan.raw_model, optimizer, fsdp=plan.sharded_state)
                eager = compiles_its_step(optimizer)
                try:
                    with tracker, _fresh_module_stats(plan, tracker), _eager_if(eager):
                        out = self.inner(step)
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001 - the tracker failing must not end the run: said, step retaken
                    return self._untracked(step, e)
                found = tracker.breakdown(self.top)
                if eager:
                    found.notes.append("the tracked step ran eagerly (torchao's optimizer step is compiled with "
                                       "fullgraph, which the tracker cannot follow): its temporaries are eager's")
                if plan.notes.get("checkpointed_blocks"):
                    found.notes.append("activation checkpointing: the recomputed activations are counted as Temp "
                                       "(the peak is right); read Activation + Temp")
        peak: int | None = measured["allocated"] + (0 if self.device.type == "cuda" else base)
        if measured["source"].startswith("not measured"):
            peak = None
        figures = {**found.to_dict(), "step": step, "measured_peak_bytes": peak,
                   "measured_peak_source": measured["source"], "measured": True}
        if "reserved_free" in measured:
            figures["reserved_free_bytes"] = measured["reserved_free"]
        if found.method.startswith("peak only"):
            figures["peak_bytes"] = peak
        self._store(figures)
        self.sink.write({"kind": "memory", "step": step, "peak_bytes": figures["peak_bytes"],
                         "measured_peak_bytes": peak, **{f"{c.lower()}_bytes": v for c, v in found.categories.items()},
                         **({"reserved_free_bytes": measured["reserved_free"]} if "reserved_free" in measured else {})})
        log.info(one_line(f"memory at step {step}:", found.categories, figures["peak_bytes"])
                 if found.categories else f"memory at step {step}: peak {size(peak or 0)} (peak only: no tracker)")
        return out

    def _untracked(self, step: int, e: BaseException) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The tracker failed inside the step (a compiled graph it cannot follow, say): the
        step's gradients are dropped and it is taken again, untracked, on the next batch."""
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        log.warning(f"memory.breakdown: the tracker failed at step {step} ({reason}); that step was taken again "
                    "without it on the next batch, and the run has no breakdown")
        self.inner.optimizer.zero_grad(set_to_none=True)
        self._store({"failed": reason, "step": step})
        return self.inner(step)

    def _store(self, breakdown: dict[str, Any]) -> None:
        self.result = breakdown
        self.metrics.extra.setdefault("memory", {})["breakdown"] = breakdown


@contextmanager
def _fresh_module_stats(plan: Any, tracker: CategoryTracker) -> Iterator[None]:
    """The tracker's module figures are per forward: under gradient accumulation they start
    again at each micro-step (the plan's micro-step context is where one begins)."""
    inner = plan.micro_step_context

    @contextmanager
    def context(i: int, n: int) -> Iterator[None]:
        tracker.new_step()
        with inner(i, n):
            yield

    plan.micro_step_context = context
    try:
        yield
    finally:
        plan.micro_step_context = inner


def _live_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages alive before the step: parameters, buffers, gradients,
    optimizer state."""
    seen: dict[int, int] = {}
    tensors: list[Any] = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    for t in (inner for tensor in tensors for inner in _plain(tensor)):
        if t.device.type == "cpu":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def compiles_its_step(optimizer: torch.optim.Optimizer) -> bool:
    """torchao's optimizers (optim=adamw8bit|adamw4bit) compile their step with fullgraph=True,
    which fails under the tracker's dispatch mode and leaves the compiled function unusable
    after; the tracked step runs them eagerly instead."""
    return type(optimizer).__module__.startswith("torchao.optim")


def _eager_if(eager: bool) -> AbstractContextManager[Any]:
    """torch's public compiler stance: every torch.compile'd function runs its Python code."""
    return torch.compiler.set_stance("force_eager") if eager else nullcontext()


def _plain(t: Any) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s bytes: itself, or for a tensor subclass that wraps others
    (torchao's 8/4-bit optimizer state: codes, scales, map) those, by torch's subclass
    protocol ``__tensor_flatten__`` (a wrapper has no storage of its own)."""
    if not isinstance(t, torch.Tensor):
        return []
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _plain(getattr(t, name))]


@contextmanager
def _measured_peak(device: torch.device) -> Iterator[dict[str, Any]]:
    """The step's peak measured the usual way, filled in on exit."""
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device)
        out.update(allocated=allocated, source="torch.cuda.max_memory_allocated",
                   reserved_free=torch.cuda.max_memory_reserved(device) - allocated)
        return
    # profile=true is recording: one profiler at a time (torch has no public query of this flag)
    if torch.autograd.profiler._is_profiler_enabled:
        yield out
        out.update(allocated=0, source="not measured: torch.profiler was already recording (profile=true)")
        return
    with _profiled() as peak:
        yield out
    out.update(allocated=peak(), source="bytes live before the step + torch.profiler's peak of the step's allocations")


@contextmanager
def _profiled() -> Iterator[Any]:
    """torch.profiler with memory on around the step; yields a function giving the peak of
    the bytes allocated during it (its trace's ``Total Allocated``, from the profile's start)."""
    from torch.profiler import ProfilerActivity, profile

    result = {"peak": 0}
    prof: AbstractContextManager[Any] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # kineto prints "profiler_start" / "profiler_stop" lines on stderr at its default level, which
    # read as noise in a training log; a level the user set stays
    with environment_default("KINETO_LOG_LEVEL", "9"), prof as p:
        yield lambda: result["peak"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        p.export_chrome_trace(str(path))
        events = [e["args"] for e in json.loads(path.read_text()).get("traceEvents", [])
                  if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if events:
        start = events[0]["Total Allocated"] - events[0].get("Bytes", 0)
        result["peak"] = max(e["Total Allocated"] for e in events) - start
