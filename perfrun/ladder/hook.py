"""What a sweep's job changes before it trains, in one call from the Hydra app: a job the
sweep dir holds measured already is not run again (``resume=auto``), a ladder rung takes
the time budget the sweep's calibration planned for its kind, and a rung's memory
breakdown is taken in its repeat 0 only."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from perfrun.config import TrainConfig

log = logging.getLogger("perfrun")


def sweep_job(cfg: TrainConfig, run_dir: Path, overrides: list[str], sweep_dir: Path) -> TrainConfig | None:
    """The configuration this job of a sweep runs; None where it is not run (measured before)."""
    if measured_before(cfg, run_dir, overrides):
        return None
    return breakdown_in_repeat_0(with_planned_budget(cfg, sweep_dir))


def measured_before(cfg: TrainConfig, run_dir: Path, overrides: list[str]) -> bool:
    """A sweep job with ``resume=auto`` that the sweep dir already holds measured: True, with a
    log line, and the job is not run again."""
    from perfrun.ladder.jobs import already_measured

    if cfg.resume != "auto":
        return False
    status = already_measured(run_dir, overrides)
    if status is not None:
        log.info(f"resume=auto: job {run_dir.name} is already {status} in {run_dir}; kept, not run again")
    return status is not None


def with_planned_budget(cfg: TrainConfig, sweep_dir: Path) -> TrainConfig:
    """The job with the time budget the sweep's calibration gives its rung kind in
    ``ablation.budget_s``, unless the command line set one."""
    from perfrun.ladder.plan import budget_for

    planned = budget_for(sweep_dir, cfg) if cfg.ablation.budget_s is None else None
    if planned is None:
        return cfg
    log.info(f"rung {cfg.ablation.rung or '?'}: measured within a {planned[0]:g} s budget ({planned[1]})")
    return replace(cfg, ablation=replace(cfg.ablation, budget_s=planned[0]))


def breakdown_in_repeat_0(cfg: TrainConfig) -> TrainConfig:
    """A ladder rung's memory breakdown (one step under torch's memory tracker, seconds on a
    CPU) is taken in its repeat 0 only: one step's memory is the same in every repeat, and
    the report reads each rung's breakdown from the jobs that have one."""
    if not (cfg.memory.breakdown and cfg.ablation.rung and cfg.repeat > 0):
        return cfg
    log.info(f"rung {cfg.ablation.rung}: memory breakdown taken in repeat 0 (one step's memory is the same in every "
             "repeat)")
    return replace(cfg, memory=replace(cfg.memory, breakdown=False))
