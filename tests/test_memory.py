"""Where a run's memory goes (memory.breakdown=true): one real tiny run tracks one step after
the warm-up (the only tracked step of this file); its categories sum to within 5 % of the
peak measured the usual way, it lands in summary.json, metrics.jsonl and one log line, and
it stays out of tokens/s. torch's private tracker is where perfrun expects it (a loud
failure if torch moves it), and without it the run says "peak only". The ladder's report
names the category a memory knob freed and draws one stacked bar per rung."""

from __future__ import annotations

import importlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from perfrun.ladder.analysis import read_sweep
from perfrun.loop.run import run
from perfrun.memory import tracker as memory_tracker
from perfrun.memory.breakdown import one_line
from perfrun.memory.estimate import estimate
from perfrun.memory.tracker import CATEGORIES

from conftest import make_cfg

STEPS = ["max_steps=5", "timing_warmup_steps=2", "log_every=5", "data=synthetic", "data.vocab_size=256"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> tuple[Path, dict[str, Any], str]:
    """One tiny run with memory.breakdown=true: its run dir, summary and log lines."""
    run_dir = tmp_path_factory.mktemp("tracked")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("perfrun")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        summary = run(make_cfg(*STEPS, "memory.breakdown=true"), run_dir)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return run_dir, summary, "\n".join(records)


def test_torchs_tracker_is_where_perfrun_expects_it() -> None:
    """Fails loudly when torch moves or renames its private memory tracker: then
    perfrun/memory/tracker.py is the one module to change."""
    assert memory_tracker.tracker_missing() is None
    module = importlib.import_module(memory_tracker.TRACKER_MODULE)
    names = {str(getattr(m, "value", m)) for m in module._MemRefType}
    assert set(CATEGORIES) <= names
    assert hasattr(importlib.import_module(memory_tracker.FSDP_TRACKER_MODULE), "FSDPMemTracker")


def test_a_moved_tracker_is_said_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_tracker, "TRACKER_MODULE", "torch.distributed._tools.moved_away")
    reason = memory_tracker.tracker_missing()
    assert reason is not None and "moved_away is missing" in reason
    with pytest.raises(RuntimeError, match="moved_away is missing"):
        memory_tracker.CategoryTracker(torch_module(), None)


def test_a_compiled_model_under_the_tracker_gives_no_warning_of_its_hooks() -> None:
    """torch warns when a compiled module runs under global module hooks (the tracker's,
    which only keep a stack of names): inside the tracker that warning is silenced, and
    only there (the same call under a hook of the test's own still warns)."""
    import warnings

    import torch
    from torch.nn.modules.module import register_module_forward_hook

    model = torch_module()
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        with memory_tracker.CategoryTracker(model, None):
            compiled(torch.ones(1, 2))
    hook = register_module_forward_hook(lambda *_: None)
    try:
        with warnings.catch_warnings(record=True) as outside:
            warnings.simplefilter("always")
            compiled(torch.ones(1, 2))
    finally:
        hook.remove()
    about_hooks = [w for w in outside if "global hooks" in str(w.message)]
    assert about_hooks and all(re.match(memory_tracker.COMPILED_WITH_GLOBAL_HOOKS, str(w.message)) for w in about_hooks)
    assert not [w for w in inside if "global hooks" in str(w.message)]


def torch_module() -> Any:
    import torch

    return torch.nn.Linear(2, 2)


def test_module_statistics_read_quickly_give_torchs_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker keeps its per-module statistics in perfrun's ModuleStats on this torch, and
    an estimate (categories, peak, modules) is the one torch's own dictionary gives; a module
    that is gone is not read."""
    import gc

    import torch
    from torch.utils.weak import WeakIdKeyDictionary

    quick = memory_tracker.ModuleStats
    assert memory_tracker.CategoryTracker(torch_module(), None).quick_stats
    cfg = make_cfg("data=synthetic", "data.vocab_size=256", "dataloader.batch_size=2", "model.n_layer=1")
    ours = estimate(cfg, 256, top=5).to_dict()
    monkeypatch.setattr(memory_tracker, "ModuleStats", type("TorchsOwn", (WeakIdKeyDictionary,), {}))
    torchs = estimate(cfg, 256, top=5).to_dict()
    for doc in (ours, torchs):
        del doc["seconds"]  # the one figure that differs: how long each took
    assert ours["modules"] and ours == torchs
    stats = quick()
    kept, gone = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    stats[kept], stats[gone] = "kept", "gone"
    del gone
    gc.collect()
    assert stats.values() == ["kept"]


def test_the_categories_sum_to_the_measured_peak(tracked: tuple[Path, dict[str, Any], str]) -> None:
    _, summary, _ = tracked
    b = summary["memory"]["breakdown"]
    assert b["step"] == 3 and b["method"] == "torch MemTracker" and b["measured"] is True
    total = sum(b["categories_bytes"].values())
    assert set(b["categories_bytes"]) == set(CATEGORIES) and total == b["peak_bytes"]
    assert abs(total - b["measured_peak_bytes"]) <= 0.05 * b["measured_peak_bytes"]
    assert "torch.profiler" in b["measured_peak_source"]
    assert b["categories_bytes"]["Activation"] > 0 and b["categories_bytes"]["Optstate"] > 0
    assert 0 < len(b["modules"]) <= 10 and b["modules"][0]["name"].startswith("blocks.")


def test_the_tracked_step_is_out_of_the_speed_figures(tracked: tuple[Path, dict[str, Any], str]) -> None:
    _, summary, _ = tracked
    assert summary["steady_steps"] == 5 - 2 - 1  # after the warm-up, less the tracked step


def test_the_breakdown_reaches_metrics_and_one_log_line(tracked: tuple[Path, dict[str, Any], str]) -> None:
    run_dir, summary, log_text = tracked
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (memory,) = [r for r in records if r["kind"] == "memory"]
    assert memory["step"] == 3 and memory["activation_bytes"] == summary["memory"]["breakdown"]["categories_bytes"]["Activation"]
    line = next(x for x in log_text.splitlines() if x.startswith("memory at step 3:"))
    assert len("00:00:00 " + line) <= 80 and " act " in line
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["memory"]["breakdown"]["peak_bytes"] == summary["memory"]["breakdown"]["peak_bytes"]


def test_the_estimate_matches_the_run_category_by_category(tracked: tuple[Path, dict[str, Any], str]) -> None:
    _, summary, _ = tracked
    measured = summary["memory"]["breakdown"]["categories_bytes"]
    estimated = estimate(make_cfg(*STEPS), 256).breakdown.categories
    for c in CATEGORIES:
        assert abs(estimated[c] - measured[c]) <= max(0.02 * measured[c], 2**16), c


def test_one_line_keeps_to_80_columns() -> None:
    cats = {"Parameter": 3 * 2**30, "Buffer": 5, "Gradient": 3 * 2**30, "Optstate": 6 * 2**30,
            "Activation": 70 * 2**30, "Temp": 12 * 2**30}
    line = one_line("memory at step 123456:", cats, sum(cats.values()))
    assert len("00:00:00 " + line) <= 80 and line.startswith("memory at step 123456: peak 94G = act 70G")


def plant(job: Path, rung: str, kind: str, knob: str, tps: float, act: int, temp: int) -> None:
    """A ladder job dir as perfrun.loop.run.run leaves it, with a breakdown."""
    job.mkdir(parents=True)
    cats = {"Parameter": 100, "Buffer": 0, "Gradient": 0, "Optstate": 200, "Activation": act, "Temp": temp}
    s = {"status": "completed", "overrides": [f"+ablation={rung}"], "tokens_per_s_median": tps, "peak_mem_mib": 1.0,
         "first_step_s": 0.1, "config": {"ablation": {"rung": rung, "kind": kind, "step": 4, "knob": knob}},
         "environment": {"device": "cuda", "device_name": "Test GPU", "device_memory_gib": 1.0},
         "memory": {"breakdown": {"categories_bytes": cats, "peak_bytes": sum(cats.values())}},
         "contention": {"contended": False, "evidence": []}}
    (job / "summary.json").write_text(json.dumps(s))
    (job / "metrics.jsonl").write_text("")


def test_the_ladder_names_the_category_a_memory_knob_freed(tmp_path: Path) -> None:
    from perfrun.ladder.memory_plot import memory_png

    gib = 2**30
    plant(tmp_path / "0", "compile", "ladder", "", 1000.0, 2 * gib, gib // 4)
    plant(tmp_path / "1", "checkpointing_full", "tradeoff", "checkpointing=full", 770.0, gib // 2, gib // 2)
    plant(tmp_path / "2", "largest_batch", "tradeoff", "checkpointing=none", 1100.0, 8 * gib, gib)
    (a,) = read_sweep([tmp_path]).ladders
    assert a["ladder"][0]["memory_breakdown"]["categories_bytes"]["Activation"] == 2 * gib
    full = next(t for t in a["tradeoffs"] if t["setting"] == "checkpointing=full")
    assert full["memory_verdict"] == "checkpointing=full freed 1.25 GiB of activations for 23 % of speed"
    png = memory_png(a)
    assert png is not None and png.startswith(b"\x89PNG")


def test_without_the_tracker_a_run_reports_the_peak_only_marked_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     one_thread: None) -> None:
    monkeypatch.setattr(memory_tracker, "TRACKER_MODULE", "torch.distributed._tools.moved_away")
    summary = run(make_cfg(*STEPS, "max_steps=4", "memory.breakdown=true"), tmp_path / "run")
    b = summary["memory"]["breakdown"]
    assert b["method"].startswith("peak only (no breakdown: torch.distributed._tools.moved_away is missing")
    assert b["categories_bytes"] == {} and b["peak_bytes"] == b["measured_peak_bytes"] > 0
