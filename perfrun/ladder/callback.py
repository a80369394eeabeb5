"""The Hydra callback that summarises a multirun when it ends (``hydra.callbacks`` in
conf/train.yaml), and the sweep's failed jobs as its folder tells them.

Both only read what the jobs wrote -- each job's summary.json -- through
:mod:`perfrun.report`, so ``perfrun report SWEEP_DIR`` reproduces the callback's table and
files exactly, and a launcher that runs jobs elsewhere (SLURM, a process per job) changes
nothing. The callback never fails the sweep: a problem writing the summary is one warning
line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def failed_jobs(sweep_dir: Path) -> list[str]:
    """The jobs under ``sweep_dir`` that did not complete, as their summary.json (or its
    absence) tells: ``job N (overrides): reason``. Empty when the folder holds no job. A
    ladder rung skipped as not applicable on the device did not fail."""
    from perfrun.report import ReportError, load

    try:
        report = load([sweep_dir])
    except ReportError:
        return []
    return [f"job {r.job} ({' '.join(r.overrides)}): {r.reason or r.status}"
            for r in report.rows if r.status not in ("completed", "skipped", "stopped")]


def resume_command(sweep_dir: Path) -> str | None:
    """The one command that runs the jobs a stopped sweep did not finish (and rewrites its
    summary): the sweep's own overrides as Hydra recorded them, into the same sweep dir, with
    ``resume=auto``. None when the folder holds no record of a sweep."""
    import shlex

    try:
        task = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task
    except Exception:  # noqa: BLE001 - not a sweep dir (a single run), or no record of one
        return None
    kept = [str(o) for o in task if str(o).split("=", 1)[0].lstrip("+~") not in ("resume", "hydra.sweep.dir")]
    return shlex.join(["perfrun", "train", "-m", *kept, f"hydra.sweep.dir={sweep_dir}", "resume=auto"])


def unfinished(sweep_dir: Path) -> list[str]:
    """Jobs of the sweep that were stopped, or never started, as its summaries tell."""
    from perfrun.report import ReportError, load

    try:
        rows = load([sweep_dir]).rows
    except ReportError:
        return []
    return [r.job for r in rows if r.status in ("stopped", "missing", "running")]


def saves_no_checkpoints(config: DictConfig) -> bool:
    """A sweep whose jobs save nothing to resume from (``checkpoint.at_end=false`` and no
    periodic saves), as ``+sweep=ablation`` sets: it measures, it does not train for keeps."""
    checkpoint = config.get("checkpoint")
    return checkpoint is not None and not checkpoint.get("at_end", True) and not checkpoint.get("every_n_steps", 0)


class SweepSummary(Callback):
    """On multirun start: the ladder's calibration and time estimate; after each job: the ETA;
    on multirun end: sweep_summary.csv/.json/.png in the sweep dir and the table on the console."""

    eta: Any = None
    plan: Any = None  # a ladder's SweepPlan, re-budgeted after each job toward ablation.target_s
    target_s: float | None = None
    t_start: float = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from perfrun.config import ConfigError
        from perfrun.ladder.bounds import check_sweep

        try:  # before the calibration and any job: one line, not one per job
            check_sweep(config)
        except ConfigError as e:
            from perfrun.console import error

            error(str(e))
            raise SystemExit(2) from None
        if saves_no_checkpoints(config):
            from rich.console import Console

            Console(highlight=False, soft_wrap=True).print(
                "sweep: the jobs save no checkpoints (checkpoint.at_end=false: a measurement); "
                "add checkpoint.at_end=true to keep them", markup=False)
        self.t_start = time.perf_counter()
        self.eta, self.plan = _estimate(config)
        target = OmegaConf.select(config, "ablation.target_s")
        user_budget = OmegaConf.select(config, "ablation.budget_s")
        self.target_s = float(target) if self.plan is not None and target is not None and user_budget is None else None

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        """done/total jobs, the elapsed time and what is left, after every job."""
        if self.eta is None or self.eta.total < 2:
            return
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=True)
        out.print(self.eta.job_done(int(config.hydra.job.num)), markup=False)
        if self.target_s is not None:
            from perfrun.ladder.plan import replan

            line = replan(self.plan, Path(str(config.hydra.sweep.dir)), done=self.eta.done,
                          elapsed_s=time.perf_counter() - self.t_start, target_s=self.target_s)
            if line:
                out.print(line, markup=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from perfrun.console import warn
        from perfrun.ladder.sweep_files import write_sweep_summary
        from perfrun.report import ReportError

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            write_sweep_summary(sweep_dir)
        except ReportError as e:
            warn(f"no sweep summary: {e}")
        except Exception as e:  # noqa: BLE001 - the jobs' results are on disk; never lose them to a summary bug
            warn(f"no sweep summary ({type(e).__name__}: {e}); the jobs' results are in {sweep_dir}, "
                 f"try perfrun report {sweep_dir}")


def _estimate(config: DictConfig) -> tuple[Any, Any]:
    """A ladder: calibrate, print and write its estimated wall time; any sweep: the ETA's count.
    Returns the ETA and the ladder's plan (None where there is none to re-budget)."""
    from rich.console import Console

    from perfrun.ladder import plan as sweep_plan

    try:
        jobs = sweep_plan.sweep_jobs(config)
    except Exception:  # noqa: BLE001 - a sweeper other than Hydra's basic one: no count, no ETA
        return None, None
    if not sweep_plan.is_ladder(jobs):
        return sweep_plan.Eta(len(jobs), None), None
    sweep_dir = Path(str(config.hydra.sweep.dir))
    kept = sweep_plan.earlier_estimate(sweep_dir, len(jobs))
    if kept is not None:  # resume=auto into this sweep dir: its calibration stands
        Console(highlight=False, soft_wrap=True).print(
            f"sweep: {len(jobs)} jobs, estimated {sweep_plan.duration(kept['estimate_s'])} when it started "
            f"({sweep_dir / sweep_plan.ESTIMATE_FILE}); the budgets it gave stand", markup=False)
        return sweep_plan.Eta(len(jobs), kept["per_job_s"]), None
    try:
        plan = sweep_plan.make_plan(config, jobs)
    except Exception as e:  # noqa: BLE001 - a rung that cannot run fails as its job, with its own line
        from perfrun.loop.stopping import Interrupted

        if isinstance(e, Interrupted):
            raise SystemExit(e.exit_code) from None
        from perfrun.console import first_line, warn

        warn(f"no time estimate: the calibration stopped ({first_line(e)}); the jobs run at full length")
        return sweep_plan.Eta(len(jobs), None), None
    data = sweep_plan.write_estimate(sweep_dir, plan)
    out = Console(highlight=False, soft_wrap=True)
    gone = data["skipped_jobs"] - plan.tradeoff_skips
    out.print(f"sweep: {len(jobs)} jobs ({gone} not applicable here"
              + (f", {plan.tradeoff_skips} repeats of memory trade-offs not needed" if plan.tradeoff_skips else "")
              + "), estimated "
              f"{sweep_plan.duration(data['estimate_s'])} on this machine from a calibration of "
              f"{len(plan.timings)} rung kind(s) ({sweep_dir / sweep_plan.ESTIMATE_FILE})", markup=False)
    target = OmegaConf.select(config, "ablation.target_s")
    if target is not None and data["estimate_s"] + data["calibration_s"] > target:
        out.print(f"sweep: even with the shortest measurements (a warm-up and 3 to 10 steady steps a job) the ladder "
                  "needs about "
                  f"{sweep_plan.duration(data['estimate_s'] + data['calibration_s'])}, more than "
                  f"ablation.target_s={target:g} (setup and compilation are not shortened); lower ablation.repeats "
                  "or run part of it (+ablation=naive,bf16,...)", markup=False)
    for kind, budget in plan.budgets.items():
        out.print(f"sweep: {kind} rungs measured within a {budget:g} s budget each, not the full step count "
                  f"({plan.why.get(kind, '')}; ablation.budget_s sets one for every job)", markup=False)
    return sweep_plan.Eta(len(jobs), data["per_job_s"]), plan
