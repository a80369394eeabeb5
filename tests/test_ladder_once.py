"""What a ladder measures once, not in every repeat: one step's memory is the same in every
repeat, so a rung's memory breakdown is taken in repeat 0 and the largest batch is searched
for in repeat 0; later repeats measure speed only, and say whose figures they reuse. A memory
trade-off rung runs in its first ablation.tradeoff_repeats repeats only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfrun.commands.train import train_main
from perfrun.console import kept_logging

from conftest import TINY_MODEL

QUICK = [*TINY_MODEL, "max_steps=6", "log_every=3", "eval_batches=1", "device=cpu", "progress=off",
         "timing_warmup_steps=2", "data=synthetic", "data.vocab_size=64", "dataloader.memory_budget_mib=4",
         "dataloader.max_batch_size=6", "compile=false", "precision=none"]  # one rung kind: one quick calibration


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """An in-process Hydra app configures the root logger (console and train.log handlers)."""
    with kept_logging():
        yield


@pytest.mark.slow
def test_repeat_0_takes_the_memory_breakdown_and_the_batch_search(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    assert train_main(["-m", "+sweep=ablation", "ablation.repeats=3", "+ablation=naive,largest_batch", *QUICK,
                       "ablation.target_s=null", f"hydra.sweep.dir={sweep}"]) == 0
    jobs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(6)]  # repeat 0: 0, 1
    assert [j["status"] for j in jobs] == ["completed"] * 5 + ["skipped"]
    assert "ablation.tradeoff_repeats=2" in jobs[5]["reason"] and "memory is the same" in jobs[5]["reason"]
    plan = json.loads((sweep / "sweep_estimate.json").read_text())
    assert plan["kinds"][5] is None and plan["per_job_s"][5] == 0.0 and plan["kinds"][3] is not None
    tracked = [bool(((j.get("memory") or {}).get("breakdown") or {}).get("categories_bytes")) for j in jobs[:5]]
    assert tracked == [True, True, False, False, False]
    first, again = jobs[1]["batch_size_auto"], jobs[3]["batch_size_auto"]
    assert first["searched_by"] == f"the job in {sweep / '1'}" and first["trials"]
    assert again["searched_by"] == first["searched_by"] and again["search_s"] == 0.0
    assert again["batch_size"] == first["batch_size"] == jobs[3]["config"]["dataloader"]["batch_size"]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    naive = next(e for e in summary["ladder"] if e["rung"] == "naive")
    # speed from every repeat (the rung holds all three; a busy machine may set one apart as an
    # outlier), memory from one
    assert naive["memory_breakdown"]["jobs"] == 1 and naive["jobs"] == ["0", "2", "4"]
    largest = next(t for t in summary["tradeoffs"] if t.get("largest_batch_job") == "largest_batch")
    assert largest["largest_batch"] == first["batch_size"]
