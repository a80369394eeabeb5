"""How long a ladder takes: a job bounded by time (ablation.budget_s) stops after its warm-up
and enough steady steps for a median and says so; a ladder calibrates each rung kind first,
writes its estimate, gives slow kinds (and an overrunning ladder) budgets, and prints an ETA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from perfrun.commands.train import train_main
from perfrun.ladder import plan as sweep_plan
from perfrun.loop.budget import MIN_STEADY_STEPS
from perfrun.loop.run import run

from conftest import TINY_MODEL, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_budget_stops_the_job_after_warmup_and_enough_steady_steps(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=40", "timing_warmup_steps=2", "ablation.budget_s=0.001"), tmp_path / "budget")
    assert s["status"] == "completed"
    assert s["steps"] == 2 + MIN_STEADY_STEPS and s["steady_steps"] == MIN_STEADY_STEPS
    assert s["budget"]["stopped_at_budget"] and s["budget"]["planned_steps"] == 40
    assert s["tokens_per_s_median"] > 0
    written = json.loads((tmp_path / "budget" / "summary.json").read_text())
    assert written["budget"]["stopped_at_step"] == 12
    full = run(make_cfg("max_steps=14", "log_every=4", "timing_warmup_steps=5"), tmp_path / "full")
    assert full["steps"] == 14 and "budget" not in full  # no budget: the full step count
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    windows = [(r["step"], r["steady_steps_in_interval"]) for r in rows if r.get("kind") == "train"]
    assert windows == [(4, 0), (8, 3), (12, 4), (14, 2)]  # the progress figure leaves out the median's warm-up
    assert [r["steady_tokens_per_s"] is None for r in rows if r.get("kind") == "train"] == [True, False, False, False]


def _plan(naive_step: float, bf16_step: float) -> sweep_plan.SweepPlan:
    plan = sweep_plan.SweepPlan(kinds=["none/eager", "bf16/eager", None, "bf16/eager"], steps=[100] * 4)
    plan.timings = {"none/eager": sweep_plan.Timing(1.0, 0.5, naive_step, 0.2),
                    "bf16/eager": sweep_plan.Timing(1.0, 2.0, bf16_step, 0.2)}
    return plan


def test_a_slow_kind_gets_the_naive_trainers_time_and_a_target_is_met() -> None:
    plan = _plan(0.1, 2.0)  # bf16 20x slower than the naive trainer
    sweep_plan.set_budgets(plan, OmegaConf.create({"ablation": {"budget_s": None, "target_s": None}}))
    assert plan.budgets == {"bf16/eager": 10.0}  # 100 steps x 0.1 s
    assert "20x the naive trainer's" in plan.why["bf16/eager"]
    assert plan.job_s(2) == 0.0  # a skipped rung costs nothing
    full = _plan(0.1, 2.0).total_s()
    assert plan.total_s() < full

    quick = _plan(0.1, 0.15)  # nothing slow: no budget until a target asks for one
    sweep_plan.set_budgets(quick, OmegaConf.create({"ablation": {"budget_s": None, "target_s": None}}))
    assert quick.budgets == {}
    target = 0.6 * quick.total_s()
    sweep_plan.set_budgets(quick, OmegaConf.create({"ablation": {"budget_s": None, "target_s": target}}))
    assert set(quick.budgets) == {"none/eager", "bf16/eager"} and quick.total_s() <= target * 1.01

    given = _plan(0.1, 2.0)  # ablation.budget_s given: the user's budget, none from the plan
    sweep_plan.set_budgets(given, OmegaConf.create({"ablation": {"budget_s": 5.0, "target_s": None}}))
    assert given.budgets == {}


def test_eta_counts_jobs_and_scales_the_plan() -> None:
    eta = sweep_plan.Eta(3, [10.0, 10.0, 10.0])
    line = eta.job_done(0)
    assert line.startswith("sweep: 1/3 jobs done,") and "elapsed, about" in line and line.endswith("left")
    assert eta.job_done(1).startswith("sweep: 2/3 jobs done")
    assert sweep_plan.duration(3725) == "1h02m" and sweep_plan.duration(75) == "1m15s"


@pytest.mark.slow
def test_a_ladder_estimates_its_time_first_and_its_jobs_take_the_budgets(tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "ladder"
    rc = train_main(["-m", "+sweep=ablation", "+ablation=naive,bf16,tf32", "ablation.repeats=1", *TINY_MODEL,
                     "max_steps=20", "timing_warmup_steps=1", "eval_batches=1", "device=cpu", "progress=off",
                     "monitor.every_n_steps=0", "ablation.target_s=0.1", f"hydra.sweep.dir={sweep}"])
    out = capfd.readouterr().out
    assert rc == 0
    estimate = json.loads((sweep / sweep_plan.ESTIMATE_FILE).read_text())
    assert estimate["jobs"] == 3 and estimate["skipped_jobs"] == 1  # tf32 does not act on a CPU
    assert estimate["kinds"] == ["none/eager", "bf16/eager", None] and estimate["estimate_s"] > 0
    assert "estimated" in out and "sweep: 1/3 jobs done" in out and "sweep: 3/3 jobs done" in out
    for job, kind in (("0", "none/eager"), ("1", "bf16/eager")):
        s = json.loads((sweep / job / "summary.json").read_text())
        assert s["budget"]["budget_s"] == estimate["budgets"][kind]  # what the plan gave this kind
        assert s["steps"] >= 1 + MIN_STEADY_STEPS
    assert json.loads((sweep / "2" / "summary.json").read_text())["status"] == "skipped"
    assert (sweep / "sweep_summary.json").is_file()


def test_a_slow_step_fills_its_budget_with_fewer_steady_steps() -> None:
    """TimeBudget on a clock that moves 1 s a step (a step so slow that 3 steady steps fill a
    2.5 s budget), and 0.01 s a step (the 10-step floor holds)."""
    from perfrun.loop import budget as budget_module

    for step_s, stops_after in ((1.0, 2 + 3), (0.01, 2 + MIN_STEADY_STEPS)):
        clock = [0.0]
        b = budget_module.TimeBudget(0.001 if step_s < 1 else 2.5, warmup_steps=2, max_steps=100,
                                     clock=lambda clock=clock: clock[0])
        b.start(0)
        step = 0
        while True:
            step += 1
            clock[0] += step_s
            if b.spent(step):
                break
        assert step == stops_after and b.summary()["budget"]["steady_steps"] == stops_after - 2


def test_the_budgets_are_replanned_after_each_job_to_end_within_the_target(tmp_path: Path) -> None:
    """Jobs that ran twice their estimate (a graph compiled for the first time, a batch search):
    the jobs left get a smaller shared budget, written where they read it, so that they fit
    the time left; jobs on time leave the budget where it is."""
    from perfrun.ladder import plan as sweep_plan
    from perfrun.ladder.plan import SweepPlan, Timing

    t = Timing(setup_s=0.5, first_step_s=1.0, step_s=0.1, eval_s=0.0)
    plan = SweepPlan(kinds=["none/eager"] * 20, steps=[100] * 20, timings={"none/eager": t})
    plan.budgets, plan.why = {"none/eager": 5.0}, {"none/eager": "the ladder would overrun ablation.target_s=100"}
    sweep_plan.write_estimate(tmp_path, plan)
    per_job = plan.job_s(0)  # 0.5 + 5.0: the budget bounds the training
    line = sweep_plan.replan(plan, tmp_path, done=set(range(10)), elapsed_s=2 * 10 * per_job, target_s=200)
    budget = json.loads((tmp_path / sweep_plan.ESTIMATE_FILE).read_text())["budgets"]["none/eager"]
    # 88 s for the 10 jobs left, at twice their estimate: the jobs end 1 % before the target,
    # leaving the rest to the process's start and the sweep summary
    left_s = sweep_plan.JOBS_SHARE * 200 - 2 * 10 * per_job
    assert 3.5 < budget < 5.0 and 2 * 10 * (0.5 + budget) <= left_s + 0.5 < 200 - 2 * 10 * per_job
    assert line is not None and "2.0x their estimate" in line and f"{budget:g} s each" in line
    on_time = SweepPlan(kinds=["none/eager"] * 20, steps=[100] * 20, timings={"none/eager": t})
    on_time.budgets, on_time.why = {"none/eager": 4.5}, dict(plan.why)
    sweep_plan.write_estimate(tmp_path, on_time)
    assert sweep_plan.replan(on_time, tmp_path, done=set(range(10)), elapsed_s=10 * on_time.job_s(0),
                             target_s=20 * on_time.job_s(0)) is None
    # a kind far slower than the naive trainer keeps its own, smaller budget through a re-plan
    mixed = SweepPlan(kinds=["none/eager", "bf16/eager"] * 10, steps=[100] * 20,
                      timings={"none/eager": t, "bf16/eager": Timing(0.5, 1.0, 1.0, 0.0)})
    sweep_plan.set_budgets(mixed, OmegaConf.create({"ablation": {"budget_s": None, "target_s": None}}))
    assert mixed.slow == mixed.budgets == {"bf16/eager": 10.0}  # 100 naive steps of 0.1 s
    sweep_plan.write_estimate(tmp_path, mixed)
    sweep_plan.replan(mixed, tmp_path, done=set(range(4)), elapsed_s=sum(mixed.job_s(i) for i in range(4)),
                      target_s=10_000)
    assert mixed.budgets["bf16/eager"] == 10.0 and mixed.budgets["none/eager"] > 10.0
