"""dataloader.batch_size=auto: the search finds planted limits, the CPU memory accounting is
real, and the search leaves the run exactly as a run given that batch size."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from perfrun.config import ConfigError
from perfrun.loop.run import run
from perfrun.loop.setup import Resolved, setup
from perfrun.loop.step import TrainStep
from perfrun.memory.batch_size import NoBatchFits, search
from perfrun.memory.trial import LiveTensorMemory
from perfrun.validate import validate

from conftest import make_cfg


@pytest.mark.parametrize("limit", [1, 2, 5, 37, 64, 1000])
@pytest.mark.parametrize("oom", [False, True])
def test_search_finds_a_planted_limit(limit: int, oom: bool) -> None:
    calls: list[int] = []

    def trial(b: int) -> bool:
        calls.append(b)
        if b > limit and oom:
            raise torch.OutOfMemoryError(f"planted: {b} > {limit}")
        return b <= limit

    r = search(trial, margin=0.1)
    assert r.max_fit == limit and r.first_fail == limit + 1
    assert r.batch_size == max(1, math.floor(limit * 0.9 + 1e-9))
    assert len(calls) == len(set(calls)), "a batch size was tried twice"
    assert len(calls) <= 2 * math.ceil(math.log2(limit + 1)) + 2  # growth + bisection, not a linear scan
    assert [b for b, _ in r.trials] == calls


def test_search_from_a_start_above_the_limit_goes_down() -> None:
    r = search(lambda b: b <= 20, start=64, margin=0.0)
    assert (r.batch_size, r.max_fit, r.first_fail) == (20, 20, 21)


def test_a_search_started_near_the_answer_never_tries_far_past_it() -> None:
    """batch_size=auto starts at the estimate's batch: from there the search gallops (+1, +2,
    +4, ...), so no trial runs a batch far larger than what fits (a CUDA trial past the limit
    costs an out-of-memory and a cache flush)."""
    tried: list[int] = []
    r = search(lambda b: tried.append(b) or b <= 21, start=20)
    assert (r.max_fit, r.first_fail) == (21, 22)
    assert max(tried) <= 20 + 2 * (21 - 20) + 1, tried


def test_cap_stops_growth_without_a_margin() -> None:
    r = search(lambda b: True, cap=48, margin=0.25)
    assert (r.batch_size, r.max_fit, r.first_fail) == (48, 48, None)
    assert max(b for b, _ in r.trials) == 48


def test_nothing_fits_raises() -> None:
    with pytest.raises(NoBatchFits) as e:
        search(lambda b: False)
    assert e.value.trials == [(1, False)]


def test_other_errors_are_not_swallowed() -> None:
    def trial(b: int) -> bool:
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        search(trial)


def test_live_tensor_memory_counts_allocations_and_frees() -> None:
    mib = 2**20
    with LiveTensorMemory(base_bytes=mib) as m:
        a = torch.empty(mib, dtype=torch.uint8)
        b = a[10:]  # a view: no new memory
        c = torch.zeros(2 * mib, dtype=torch.uint8)
        assert m.live == 3 * mib
        del c
        assert m.live == mib
        del a, b
        assert m.live == 0
    assert m.peak == 3 * mib and m.peak_bytes == 4 * mib
    with pytest.raises(torch.OutOfMemoryError), LiveTensorMemory(base_bytes=mib, limit_bytes=2 * mib) as m2:
        torch.empty(2 * mib, dtype=torch.uint8)
    assert m2.exceeded


@pytest.mark.parametrize("value, ok", [("auto", True), (8, True), (0, False), ("abc", False), (True, False), (2.5, False)])
def test_batch_size_validation(value: object, ok: bool) -> None:
    cfg = make_cfg()
    cfg.dataloader.batch_size = value
    if ok:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    message = str(e.value)
    assert "dataloader.batch_size=" in message and "auto" in message and "\n" not in message


def _train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
def test_auto_on_cpu_respects_the_budget_and_leaves_the_run_untouched(tmp_path: Path) -> None:
    common = ["max_steps=4", "log_every=1", "timing_warmup_steps=1"]
    cfg = make_cfg(*common, "dataloader.batch_size=auto", "dataloader.memory_budget_mib=3")
    auto = run(cfg, tmp_path / "auto")
    a = auto["batch_size_auto"]
    # setup found the batch, the tokenizer and the vocabulary without writing them into the
    # configuration: they are its own record, and the recorded config has them in place
    assert cfg == make_cfg(*common, "dataloader.batch_size=auto", "dataloader.memory_budget_mib=3")
    assert (cfg.dataloader.batch_size, cfg.data.vocab_size) == ("auto", None)
    assert auto["resolved"] == {"device": "cpu", "batch_size": a["batch_size"], "tokenizer": "byte", "vocab_size": 256,
                                "vocab_size_padded": auto["vocab_size_padded"]}
    assert auto["config"]["data"]["tokenizer"] == "byte" and auto["config"]["data"]["vocab_size"] == 256
    trials = {b: (ok, peak) for b, ok, peak in a["trials"]}
    assert a["stopped_by"] == "memory" and a["method"].startswith("live tensor bytes")
    assert trials[a["max_fit"]][0] and trials[a["max_fit"]][1] <= 3
    assert not trials[a["first_fail"]][0] and trials[a["first_fail"]][1] > 3
    assert a["first_fail"] == a["max_fit"] + 1
    assert auto["config"]["dataloader"]["batch_size"] == a["batch_size"] == math.floor(a["max_fit"] * 0.9 + 1e-9)
    assert auto["tokens_per_step"] == a["batch_size"] * auto["seq_len"]
    # the search starts at the estimate's batch and gallops from there: a trial that fits and
    # one that does not, at least; measured memory grows with the batch (a failed trial stops
    # where it crossed the budget, above every trial that fitted)
    fitted = [peak for _, ok, peak in sorted(a["trials"]) if ok]
    failed = [peak for _, ok, peak in a["trials"] if not ok]
    assert fitted and failed and fitted == sorted(fitted) and min(failed) > max(fitted)
    # The search must not move the weights, the optimizer state or the RNG: the run that
    # follows is the run given that batch size from the start.
    fixed = run(make_cfg(*common, f"dataloader.batch_size={a['batch_size']}"), tmp_path / "fixed")
    assert fixed["batch_size_auto"] is None
    assert _train_losses(tmp_path / "auto") == _train_losses(tmp_path / "fixed")
    # the trials run the knobs: checkpointed activations leave room for a larger batch
    ckpt = run(make_cfg("max_steps=1", "dataloader.batch_size=auto", "dataloader.memory_budget_mib=3",
                        "checkpointing=full"), None)
    assert ckpt["batch_size_auto"]["max_fit"] > a["max_fit"]


def test_trials_take_the_trainers_step_and_give_back_the_schedule_and_loss_scale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trial is one call of the trainer's TrainStep (fp16: its scaled backward and the
    scaler's update; its schedule step); after the search the weights, the schedule and the
    loss scale are those of a run given the batch size."""
    calls: list[int] = []
    real_call = TrainStep.__call__
    monkeypatch.setattr(TrainStep, "__call__", lambda self, step: calls.append(step) or real_call(self, step))
    common = ["precision=fp16", "optim.warmup_steps=2", "data=synthetic", "data.vocab_size=64"]
    with ExitStack() as stack:
        auto = setup(make_cfg(*common, "dataloader.batch_size=auto", "dataloader.memory_budget_mib=64",
                              "dataloader.max_batch_size=2"), stack, Resolved())
        trials = auto.facts["batch_size_auto"]["trials"]
        # the search starts where the memory estimate says (here the cap, 2): one call per trial
        assert [b for b, _, _ in trials] == [2] and len(calls) == 1
        assert auto.facts["batch_size_auto"]["estimate"]["largest_batch"] == 2
        fixed = setup(make_cfg(*common, "dataloader.batch_size=2"), stack, Resolved())
        assert auto.scheduler.state_dict() == fixed.scheduler.state_dict()
        assert auto.plan.state_dict() == fixed.plan.state_dict() and auto.plan.state_dict() is not None
        assert auto.optimizer.state_dict()["state"] == {}
        pairs = zip(auto.plan.raw_model.parameters(), fixed.plan.raw_model.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def test_auto_cap_stops_the_search(tmp_path: Path) -> None:
    capped = run(make_cfg("max_steps=1", "dataloader.batch_size=auto", "dataloader.memory_budget_mib=3",
                          "dataloader.max_batch_size=3"), None)
    assert capped["batch_size_auto"]["batch_size"] == 3 and capped["batch_size_auto"]["first_fail"] is None
    assert capped["batch_size_auto"]["stopped_by"] == "dataloader.max_batch_size"


@pytest.mark.parametrize("extra, words", [
    ([], "needs dataloader.memory_budget_mib"),
    (["dataloader.memory_budget_mib=0.01"], "not even a batch of 1 fits"),
])
def test_auto_bad_budget_is_one_line(tmp_path: Path, extra: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        run(make_cfg("max_steps=1", "dataloader.batch_size=auto", *extra), tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_a_repeat_of_the_same_job_reuses_its_search_and_another_job_searches() -> None:
    """FoundBatches, as a sweep holds it (the real sweep: tests/test_ladder_once.py): what
    differs between repeats (the repeat's number, whether repeat 0 tracks the memory) keys the
    same search; any other difference, or another device, searches again."""
    from perfrun.config import as_dict
    from perfrun.memory.found_batches import FoundBatches

    found, searches = FoundBatches(), []

    def search() -> dict[str, object]:
        searches.append(1)
        return {"batch_size": 10 + len(searches), "search_s": 1.5, "trials": [[8, True, 1.0]]}

    def key(*overrides: str, device: str = "cpu") -> str:
        return FoundBatches.key(as_dict(make_cfg("dataloader.batch_size=auto", *overrides)), torch.device(device))

    first = found.reuse_or_search(key("repeat=0", "memory.breakdown=true"), search, "the job in 0")
    again = found.reuse_or_search(key("repeat=3", "memory.breakdown=false"), search, "the job in 3")
    assert first == {"batch_size": 11, "search_s": 1.5, "trials": [[8, True, 1.0]], "searched_by": "the job in 0"}
    assert again == {**first, "search_s": 0.0} and len(searches) == 1
    other = found.reuse_or_search(key("repeat=3", "checkpointing=full"), search, "the job in 4")
    elsewhere = found.reuse_or_search(key("repeat=0", "memory.breakdown=true", device="meta"), search, "the job in 5")
    assert (other["batch_size"], other["searched_by"]) == (12, "the job in 4")
    assert (elsewhere["batch_size"], elsewhere["searched_by"]) == (13, "the job in 5") and len(searches) == 3
