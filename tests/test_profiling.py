"""Seeing inside a run: profiler traces and the step-time breakdown, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfrun.telemetry.throughput import PHASES
from perfrun.train import run

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


def test_step_breakdown_accounts_for_the_step(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=12", "accumulation.steps=2", "timing_warmup_steps=2"), tmp_path)
    b = s["step_breakdown"]
    assert b["method"] == "time.perf_counter" and b["steps"] == 10
    assert set(b["median_ms"]) == set(PHASES) and all(v >= 0 for v in b["median_ms"].values())
    assert b["median_ms"]["forward"] > 0 and b["median_ms"]["backward"] > 0
    assert sum(b["share_pct"].values()) == pytest.approx(100.0)
    # the phases cover the step from its first batch to the end of the optimizer step
    assert 0.5 * s["step_time_ms_median"] < sum(b["median_ms"].values()) < 1.2 * s["step_time_ms_median"]


@pytest.mark.gpu
def test_gpu_profile_and_memory_snapshot(tmp_path: Path) -> None:
    import pickle

    s = run(make_cfg("device=cuda", "precision=bf16", "max_steps=12", "profile=true", "profiler.start_step=4",
                     "memory_snapshot=true"), tmp_path)
    assert "Self CUDA" in (tmp_path / "profile" / "top_ops.txt").read_text()
    assert s["step_breakdown"]["method"] == "CUDA events on the device timeline"
    snapshot = pickle.loads(Path(s["memory_snapshot_path"]).read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
