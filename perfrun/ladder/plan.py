"""How long a sweep will take, before it starts and while it runs.

Before a ladder (``+sweep=ablation``) starts, each distinct kind of rung (precision x
compile) trains a few steps on this device; from those, every job's wall time is estimated,
printed and written to ``sweep_estimate.json`` in the sweep dir. A rung whose step is far
slower than the naive trainer's (bf16 autocast on a CPU without bf16 units) gets a time
budget instead of the full step count, and where the whole ladder would overrun
``ablation.target_s`` every job shares one budget. The jobs read their budget from that file
(:func:`budget_for`), so a launcher that runs jobs elsewhere changes nothing. After each
job, :class:`Eta` prints done/total, the elapsed time and an estimate of the rest.
"""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from perfrun.config import TrainConfig

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

log = logging.getLogger("perfrun")

ESTIMATE_FILE = "sweep_estimate.json"
CALIBRATION_STEPS = 4  # 1 warm-up step and 3 timed ones per rung kind
SLOW_FACTOR = 4.0  # a kind whose step is this many times the naive trainer's is measured within a budget
# The jobs aim to end 1 % before ablation.target_s: the process's start before the sweep's
# first callback and the sweep summary with its plots after the last job take the rest of the
# ladder's wall time (docs/measurements.md: the ladder's wall time).
JOBS_SHARE = 0.99


def kind_of(cfg: TrainConfig | DictConfig) -> str:
    """What sets a rung's step time apart by far: its precision and whether it compiles."""
    compiled = f"compile:{cfg.compile_options.mode}" if cfg.compile else "eager"
    return f"{cfg.precision.name}/{compiled}"


def sweep_overrides(config: DictConfig) -> list[Override]:
    """The sweeper's parameters, then the command line's overrides, parsed as Hydra's basic
    sweeper reads them (a key given twice: the later wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    given = [f"{k}={v}" for k, v in params.items()] + list(OmegaConf.select(config, "hydra.overrides.task") or [])
    return OverridesParser.create().parse_overrides(given)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The sweep's jobs, one override list each, in the order Hydra's basic sweeper runs them:
    the cartesian product of every key's values (a plain override has one; a key given
    twice keeps its first place and its last values), the sweeper's ``params`` first, then
    the command line's."""
    choices: dict[str, list[str]] = {}
    for override in sweep_overrides(config):
        key = override.get_key_element()
        values = override.sweep_string_iterator() if override.is_sweep_override() else \
            [override.get_value_element_as_str()]
        choices[key] = [f"{key}={value}" for value in values]
    return [list(job) for job in itertools.product(*choices.values())]


def is_ladder(jobs: list[list[str]]) -> bool:
    return any(o.lstrip("+").startswith("ablation=") for job in jobs for o in job)


@dataclass
class Timing:
    """One rung kind's calibration: setup, first step, steady step and evaluation seconds."""

    setup_s: float
    first_step_s: float
    step_s: float
    eval_s: float

    def job_s(self, steps: int, budget_s: float | None) -> float:
        train = self.first_step_s + max(steps - 1, 0) * self.step_s
        if budget_s is not None:
            from perfrun.loop.budget import MIN_STEADY_STEPS, MIN_STEADY_STEPS_SLOW, SLOW_STEADY_S

            slow = max(MIN_STEADY_STEPS_SLOW * self.step_s, budget_s, SLOW_STEADY_S)
            steady = min(MIN_STEADY_STEPS * self.step_s, slow)
            floor = self.first_step_s + steady
            train = min(train, max(budget_s, floor))
        return self.setup_s + train + self.eval_s


@dataclass
class SweepPlan:
    """Every job's kind and steps, the kinds' timings and budgets, and the estimate."""

    kinds: list[str | None]  # per job; None: a rung skipped on this device
    steps: list[int]
    calibration_s: float = 0.0  # composing the rungs and calibrating: the target's share left to the jobs is less by this
    timings: dict[str, Timing] = field(default_factory=dict)
    budgets: dict[str, float] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    slow: dict[str, float] = field(default_factory=dict)  # kinds far slower than the naive trainer: their own budget
    tradeoff_skips: int = 0  # jobs left out as a memory trade-off's repeats past ablation.tradeoff_repeats
    ran_as: dict[int, float] = field(default_factory=dict)  # a done job's estimate with the budget it ran with

    def job_s(self, i: int) -> float:
        kind = self.kinds[i]
        if kind is None or kind not in self.timings:
            return 0.0
        return self.timings[kind].job_s(self.steps[i], self.budgets.get(kind))

    def total_s(self) -> float:
        return sum(self.job_s(i) for i in range(len(self.kinds)))


def _calibrate(cfg: DictConfig) -> Timing | None:
    """A few steps of ``cfg`` on this device, in a folder of its own that is then removed, as
    its job will run: with what the model cannot take turned off (:func:`decide`); None for a
    rung its job will skip (the model lacks what its knob needs)."""
    from perfrun.config import typed
    from perfrun.ladder.rungs import decide
    from perfrun.loop.run import run

    short = OmegaConf.merge(cfg, {"max_steps": CALIBRATION_STEPS, "timing_warmup_steps": 1, "progress": "off",
                                  "monitor": {"every_n_steps": 0}, "eval_every": 0, "eval_batches": 1,
                                  "checkpoint": {"at_end": False, "every_n_steps": 0}, "resume": None,
                                  "logger": {"name": "none"}, "ablation": {"budget_s": None}})
    decision = decide(typed(short))
    if decision.skip is not None:
        return None
    with tempfile.TemporaryDirectory(prefix="perfrun-calibration-") as tmp:
        s = run(decision.config, Path(tmp))
    step_s = (s.get("step_time_ms_median") or 0.0) / 1000
    train_s = float(s.get("train_time_s") or 0.0)
    wall = float(s.get("wall_s") or 0.0)
    setup = float(s.get("setup_s") or 0.0)
    return Timing(setup_s=setup, first_step_s=float(s.get("first_step_s") or step_s), step_s=step_s,
                  eval_s=max(wall - setup - train_s, 0.0))


def make_plan(config: DictConfig, jobs: list[list[str]]) -> SweepPlan:
    """Compose each distinct rung, calibrate each kind once, and budget the slow kinds. The
    time both take (the composition of 30 rungs takes seconds) is the ladder's before its
    first job: the jobs share what is left of the target."""
    from hydra.core.global_hydra import GlobalHydra

    from perfrun.device_conditions import rung_applies
    from perfrun.ladder.rungs import beyond_tradeoff_repeats

    t0 = time.perf_counter()
    loader = GlobalHydra.instance().config_loader()
    composed: dict[tuple[str, ...], DictConfig] = {}
    kinds: list[str | None] = []
    steps: list[int] = []
    tradeoff_skips = 0
    for job in jobs:
        key = tuple(o for o in job if not o.startswith("repeat="))
        if key not in composed:
            job_cfg = loader.load_sweep_config(config, list(job))
            with open_dict(job_cfg):  # the job's own config, as Hydra hands it to the task
                del job_cfg["hydra"]
            composed[key] = job_cfg
        cfg = composed[key]
        repeat = next((int(o.split("=", 1)[1]) for o in job if o.startswith("repeat=")), 0)
        on_device = rung_applies(str(cfg.ablation.acts_on), str(cfg.device))
        beyond = on_device and beyond_tradeoff_repeats(cfg.ablation, repeat)
        tradeoff_skips += beyond
        kinds.append(kind_of(cfg) if on_device and not beyond else None)
        steps.append(int(cfg.max_steps))
    plan = SweepPlan(kinds, steps, tradeoff_skips=tradeoff_skips)
    of_kind: dict[str, list[DictConfig]] = {}
    for cfg in composed.values():
        if rung_applies(str(cfg.ablation.acts_on), str(cfg.device)):
            of_kind.setdefault(kind_of(cfg), []).append(cfg)
    for kind, cfgs in of_kind.items():
        for cfg in cfgs:  # the first rung of the kind that this model's job will run
            log.info(f"sweep: calibrating {kind} ({CALIBRATION_STEPS} steps of rung {cfg.ablation.rung})")
            timing = _calibrate(cfg)
            if timing is not None:
                plan.timings[kind] = timing
                break
    plan.calibration_s = time.perf_counter() - t0
    set_budgets(plan, config)
    return plan


def set_budgets(plan: SweepPlan, config: Any) -> None:
    """Slow kinds: a budget of the naive trainer's training time; over ``ablation.target_s``:
    one budget for every kind, the largest that fits. ``ablation.budget_s`` given: none here."""
    if OmegaConf.select(config, "ablation.budget_s") is not None:
        return
    naive = plan.timings.get(next((k for k in plan.kinds if k and k.startswith("none/eager")), ""), None)
    steps = max(plan.steps, default=0)
    if naive is not None and naive.step_s > 0:
        for kind, t in plan.timings.items():
            ratio = t.step_s / naive.step_s
            if ratio >= SLOW_FACTOR:
                plan.slow[kind] = round(max(steps * naive.step_s, 1.0), 1)
                plan.why[kind] = f"its step is {ratio:.0f}x the naive trainer's on this device"
    plan.budgets = dict(plan.slow)
    target = OmegaConf.select(config, "ablation.target_s")
    if target is None or plan.total_s() <= JOBS_SHARE * target - plan.calibration_s:
        return
    _share_budget(plan, range(len(plan.kinds)), JOBS_SHARE * target - plan.calibration_s, scale=1.0)
    for k in plan.timings:
        plan.why.setdefault(k, f"the ladder would overrun ablation.target_s={target:g}")


def _share_budget(plan: SweepPlan, jobs: Iterable[int], room_s: float, *, scale: float) -> None:
    """The one budget every kind shares (a slow kind keeps its own where smaller): the largest,
    by bisection, whose ``jobs`` take at most ``room_s`` at ``scale`` times their estimate."""
    jobs = list(jobs)

    def total_with(shared: float) -> float:
        plan.budgets = {k: min(plan.slow.get(k, shared), shared) for k in plan.timings}
        return scale * sum(plan.job_s(i) for i in jobs)

    low, high = 1.0, max((t.first_step_s + max(plan.steps) * t.step_s for t in plan.timings.values()), default=1.0)
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if total_with(mid) <= room_s else (low, mid)
    total_with(round(low, 1))


def replan(plan: SweepPlan, sweep_dir: Path, *, done: set[int], elapsed_s: float, target_s: float) -> str | None:
    """After a job: the budgets of the jobs left, so that they fit the time left of
    ``target_s``. The estimate runs short where it cannot see a cost (a rung's graph compiled
    for the first time, a batch search), so the jobs still to come are planned at the rate the
    done ones ran against their estimate (between 0.5x and 4x); the budgets are one shared
    figure, as :func:`set_budgets` gives, written where the next jobs read them. Returns the
    line to print when the budget moved by more than a tenth, else None."""
    left = [i for i in range(len(plan.kinds)) if i not in done and plan.kinds[i] is not None]
    for i in done:
        plan.ran_as.setdefault(i, plan.job_s(i))
    planned_done = sum(plan.ran_as[i] for i in done)
    if not left or planned_done <= 0 or not plan.timings:
        return None
    scale = min(max((elapsed_s - plan.calibration_s) / planned_done, 0.5), 4.0)
    room = JOBS_SHARE * target_s - elapsed_s
    before = max(plan.budgets.values(), default=0.0)
    _share_budget(plan, left, room, scale=scale)
    for k in plan.timings:
        plan.why.setdefault(k, f"the ladder would overrun ablation.target_s={target_s:g}")
    data = json.loads((sweep_dir / ESTIMATE_FILE).read_text())
    data.update(budgets=plan.budgets, why=plan.why, replanned={"after_jobs": len(done), "elapsed_s": elapsed_s,
                                                                "rate_vs_estimate": scale, "left_s": room})
    from perfrun.checkpoint.atomic import write_json

    write_json(sweep_dir / ESTIMATE_FILE, data)
    after = max(plan.budgets.values(), default=0.0)
    if before and abs(after - before) <= 0.1 * before:
        return None
    return (f"sweep: jobs so far ran {scale:.1f}x their estimate; the {len(left)} jobs left are measured within "
            f"{after:g} s each (was {before:g} s) to end within ablation.target_s={target_s:g}")


def budget_for(sweep_dir: Path, cfg: TrainConfig) -> tuple[float, str] | None:
    """The budget the sweep's plan gives this job's kind, and why; None when it has none."""
    try:
        data = json.loads((sweep_dir / ESTIMATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    kind = kind_of(cfg)
    budget = (data.get("budgets") or {}).get(kind)
    return (float(budget), str((data.get("why") or {}).get(kind, ""))) if budget is not None else None


def earlier_estimate(sweep_dir: Path, jobs: int) -> dict[str, Any] | None:
    """The estimate a sweep dir already holds for the same number of jobs (a resumed sweep)."""
    try:
        data = json.loads((sweep_dir / ESTIMATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and data.get("jobs") == jobs and len(data.get("per_job_s") or []) == jobs
    return data if ok else None


def write_estimate(sweep_dir: Path, plan: SweepPlan) -> dict[str, Any]:
    from perfrun.checkpoint.atomic import write_json

    data = {"jobs": len(plan.kinds), "skipped_jobs": sum(1 for k in plan.kinds if k is None),
            "tradeoff_repeats_skipped": plan.tradeoff_skips,
            "estimate_s": plan.total_s(), "calibration_s": plan.calibration_s,
            "per_job_s": [plan.job_s(i) for i in range(len(plan.kinds))], "kinds": plan.kinds,
            "timings": {k: vars(t) for k, t in plan.timings.items()}, "budgets": plan.budgets, "why": plan.why,
            "method": f"{CALIBRATION_STEPS} steps of each rung kind (precision/compile) on this device, "
                      "scaled to each job's steps or budget"}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_json(sweep_dir / ESTIMATE_FILE, data)
    return data


def duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Eta:
    """After each job: done/total, elapsed, and the rest estimated from the plan (scaled by
    how the jobs so far compared with it) or, without one, from the mean job so far."""

    def __init__(self, total: int, per_job_s: list[float] | None) -> None:
        self.total, self.per_job_s = total, per_job_s
        self.done: set[int] = set()
        self.t0 = time.perf_counter()

    def job_done(self, num: int) -> str:
        self.done.add(num)
        elapsed = time.perf_counter() - self.t0
        left = [i for i in range(self.total) if i not in self.done]
        if self.per_job_s and len(self.per_job_s) == self.total:
            planned = sum(self.per_job_s[i] for i in self.done)
            scale = min(max(elapsed / planned, 0.5), 4.0) if planned > 0 else 1.0
            rest = scale * sum(self.per_job_s[i] for i in left)
        else:
            rest = elapsed / len(self.done) * len(left)
        return (f"sweep: {len(self.done)}/{self.total} jobs done, {duration(elapsed)} elapsed, "
                f"about {duration(rest)} left")
