"""The job Hydra calls with each configuration it composes for ``perfrun train``: one run,
one rung of a ladder (skipped where its knob cannot act), or a sweep's job that starts its
own ranks. A sweep's job is first shaped by the ladder's hook (:mod:`perfrun.ladder.hook`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.commands.launch import run_sweep_job_on_ranks, world_size
from perfrun.config import typed
from perfrun.console import error

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from perfrun.config import TrainConfig
    from perfrun.ladder.rungs import Decision
    from perfrun.memory.found_batches import FoundBatches

PARALLEL = ("ddp", "fsdp")  # the distributed= values that run one process per GPU

log = logging.getLogger("perfrun")


def hydra_task(args: list[str], search_root: Path | None, failed: list[str]) -> Callable[[DictConfig], None]:
    """The task for ``hydra.main``: a sweep job's failure is added to ``failed``; a single
    run's ends the process (SystemExit) with its exit code. ``args``: the command line (a
    sweep's logger names); ``search_root``: where ``resume=auto`` looks for the run to continue."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from perfrun.config import ConfigError
    from perfrun.memory.found_batches import FoundBatches

    found = FoundBatches()  # a sweep's repeats of one job reuse its batch search (batch_size=auto)

    def task(cfg: DictConfig) -> None:
        # the trainer (and torch) is imported by a job, never by --help, --cfg or --info
        from perfrun.loop.run import RunFailed
        from perfrun.loop.stopping import Interrupted

        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        overrides = list(hc.overrides.task)
        try:
            _job(cfg, run_dir, overrides, args, search_root, found, Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN
                 else None)
        except (ConfigError, RunFailed) as e:
            error(str(e))
            if hc.mode == RunMode.MULTIRUN:
                failed.append(f"job {hc.job.num} ({' '.join(overrides)}): {e}")
                return
            raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
        except Interrupted as e:
            error(str(e))
            raise SystemExit(e.exit_code) from None  # a stop request ends the sweep too

    return task


def _job(cfg: DictConfig, run_dir: Path, overrides: list[str], args: list[str], search_root: Path | None,
         found: FoundBatches, sweep_dir: Path | None) -> None:
    """One job: typed once (``cfg`` stays as Hydra composed it), shaped by the ladder's hook
    in a sweep, then a rung's decision, then the ranks it starts or the run in this process."""
    from perfrun.loop.run import RunFailed

    config = typed(cfg)
    if sweep_dir is not None:
        from perfrun.ladder.hook import sweep_job

        shaped = sweep_job(config, run_dir, overrides, sweep_dir)
        if shaped is None:
            return
        config = shaped
    decision = None
    if config.ablation.rung and world_size() == 1:  # a ladder rung: skipped where its knob cannot act
        from perfrun.ladder.rungs import decide, skip

        decision = decide(config)
        if decision.skip is not None:
            skip(config, run_dir, overrides, decision.skip)
            return
    if config.distributed in PARALLEL and config.nproc > 1 and world_size() == 1:
        if decision is not None:  # the ranks start with what the model cannot take turned off
            config, overrides = decision.config, [*overrides, *decision.turned_off]
        code = run_sweep_job_on_ranks(config, overrides, run_dir, sweep_args=args, search_root=search_root)
        if code in (130, 143):  # the ranks were stopped by a signal: so is the sweep
            raise SystemExit(code)
        if code != 0:  # the ranks have printed why
            raise RunFailed(f"its {config.nproc} ranks exited with code {code}; see {run_dir / 'train.log'}")
        return
    _train_here(cfg, config, run_dir, overrides, args, search_root, found, decision)


def _train_here(cfg: DictConfig, config: TrainConfig, run_dir: Path, overrides: list[str], args: list[str],
                search_root: Path | None, found: FoundBatches, decision: Decision | None) -> None:
    """The run (or the rung) in this process, its run dir's contents logged at the end."""
    from perfrun.checkpoint.resume_search import RunSearch, job_config
    from perfrun.loop.run import run
    from perfrun.telemetry.sinks import shown_path

    log.info(f"run dir {shown_path(run_dir)}")
    search = RunSearch(search_root, job_config(cfg), run_dir) if search_root is not None else None
    try:
        if config.ablation.rung:
            from perfrun.ladder.rungs import run_rung

            run_rung(config, run_dir, overrides=overrides, search=search, sweep_args=args, decision=decision,
                     found=found)
        else:
            run(config, run_dir, overrides=overrides, search=search, sweep_args=args, found=found)
    finally:
        log.info(f"run dir {shown_path(run_dir)}: {contents(run_dir)}")


def contents(run_dir: Path) -> str:
    return ", ".join(p.name + ("/" if p.is_dir() else "") for p in sorted(run_dir.iterdir())
                     if not p.name.startswith("."))
