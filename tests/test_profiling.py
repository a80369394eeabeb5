"""Seeing inside a run: profiler traces and the step-time breakdown, on the CPU."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from perfrun.loop.run import run
from perfrun.telemetry import step_metrics
from perfrun.telemetry.step_metrics import PHASES

from conftest import make_cfg


def test_profile_writes_a_trace_that_parses(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=12", "profile=true", "profiler.start_step=4", "profiler.warmup=1",
                     "profiler.active=2"), tmp_path)
    assert s["knobs"]["profile"]["steps"] == [6, 7]
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls were recorded
    assert any(p.name.endswith(".pt.trace.json") for p in (tmp_path / "profile" / "tensorboard").iterdir())
    top = (tmp_path / "profile" / "top_ops.txt").read_text()
    assert "Self CPU" in top and "aten::" in top
    assert s["status"] == "completed" and s["steps"] == 12


def test_step_breakdown_accounts_for_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timers: list = []  # the run's own step and phase timers, to check the breakdown step by step
    for cls in (step_metrics.StepTimer, step_metrics.PhaseTimer):
        def kept(self, device, init=cls.__init__):
            init(self, device)
            timers.append(self)
        monkeypatch.setattr(cls, "__init__", kept)
    s = run(make_cfg("max_steps=12", "accumulation.steps=2", "timing_warmup_steps=2"), tmp_path)
    b = s["step_breakdown"]
    assert b["method"] == "time.perf_counter" and b["steps"] == 10
    assert set(b["median_ms"]) == set(PHASES) and all(v >= 0 for v in b["median_ms"].values())
    assert b["median_ms"]["forward"] > 0 and b["median_ms"]["backward"] > 0
    assert sum(b["share_pct"].values()) == pytest.approx(100.0)
    (steps,) = [t for t in timers if isinstance(t, step_metrics.StepTimer)]
    (phases,) = [t for t in timers if isinstance(t, step_metrics.PhaseTimer)]
    for p in PHASES:  # the summary's figures are the medians of the steady steps
        assert b["median_ms"][p] == pytest.approx(1000 * statistics.median(phases.seconds[p][2:]))
    # the phases cover the step from its first batch to the end of the optimizer step: within
    # each step, and most of it. Step by step, because on a busy machine another process's time
    # slice lands in one phase of one step, so medians taken phase by phase need not add up to
    # the median step.
    covered = [sum(phases.seconds[p][i] for p in PHASES) for i in range(12)]
    assert all(c <= d + 1e-9 for c, d in zip(covered, steps.durations, strict=True))
    assert statistics.median(c / d for c, d in zip(covered, steps.durations, strict=True)) > 0.5


@pytest.mark.gpu
def test_gpu_profile_and_memory_snapshot(tmp_path: Path) -> None:
    import pickle

    s = run(make_cfg("device=cuda", "precision=bf16", "max_steps=12", "profile=true", "profiler.start_step=4",
                     "memory_snapshot=true"), tmp_path)
    assert "Self CUDA" in (tmp_path / "profile" / "top_ops.txt").read_text()
    assert "Self CPU" in (tmp_path / "profile" / "top_ops_cpu.txt").read_text()
    gpu = s["knobs"]["profile"]["gpu"]
    assert gpu["steps"] == 3 and 0 < gpu["kernel_ms_per_step"] <= gpu["wall_ms_per_step"]
    assert 0 < gpu["gpu_busy_pct"] <= 100 and gpu["kernels_per_step"] > 10
    assert s["step_breakdown"]["method"] == "CUDA events on the device timeline"
    snapshot = pickle.loads(Path(s["memory_snapshot_path"]).read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]


def test_gpu_busy_merges_overlapping_kernels_within_the_device_step_marks(tmp_path: Path) -> None:
    """A hand-written Chrome trace: two device-side steps of 10 ms, kernels that overlap
    (two streams) and one outside the steps; the host-side marks must not count."""
    import gzip

    from perfrun.telemetry.profiling import gpu_busy

    def x(name: str, cat: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [
        x("ProfilerStep#1", "user_annotation", 0, 3000), x("ProfilerStep#2", "user_annotation", 3000, 3000),
        x("ProfilerStep#1", "gpu_user_annotation", 1000, 10000), x("ProfilerStep#2", "gpu_user_annotation", 11000, 10000),
        x("gemm", "kernel", 1000, 4000), x("gemm2", "kernel", 3000, 4000),  # 1000-7000 covered once: 6 ms
        x("add", "kernel", 12000, 2000),  # 2 ms
        x("late", "kernel", 25000, 5000),  # after the steps: not counted
        x("aten::mm", "cpu_op", 0, 9000),
    ]
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    b = gpu_busy(trace)
    assert b == {"steps": 2, "wall_ms_per_step": 10.0, "kernel_ms_per_step": 4.0, "gpu_busy_pct": 40.0,
                 "kernels_per_step": 1.5}
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": events[:2]}))
    with pytest.raises(ValueError, match="no step marks on the device timeline"):
        gpu_busy(cpu_only)
