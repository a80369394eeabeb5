"""``perfrun train``: a plain run composes its configuration once, to check it (one line for
a mistake) and find its run dir (``resume=auto``), and runs that composition through Hydra's
own job machinery (:func:`perfrun.commands.hydra_app.run_composed`); anything with a flag
(``-m``, ``--cfg job``, ``--help``, ``--info``, shell completion) goes to a real Hydra app
with the rest of the command line. What several processes need (torchrun, one run dir for
every rank) is in :mod:`perfrun.commands.launch`.
Hydra's completion script calls ``perfrun -sc query=bash`` with the whole line in
COMP_LINE; the ``train`` word is removed from it here, since Hydra knows no subcommands,
and the answer is composed without importing the trainer (no torch), so a Tab is quick.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.checkpoint.run_lock import undone_if_refused
from perfrun.commands.launch import (
    arg_value,
    dir_overrides,
    hydra_dirs,
    hydra_node,
    join_rank_group,
    launch_ranks,
    quoted,
    run_sweep_job_on_ranks,
    take_search_root,
    validate_job,
    world_size,
)
from perfrun.commands.resume_target import continue_run, template_root
from perfrun.config import TrainConfig, config_dir, typed
from perfrun.console import composition_error, error, first_line

PARALLEL = ("ddp", "fsdp")  # the distributed= values that run one process per GPU
COMPLETION_FLAGS = ("-sc", "--shell-completion")
HYDRA_ANSWERS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info")  # no job runs
CONFIG_ROOM = 64 * 1024  # bytes a run dir must take before the job starts: Hydra's .hydra/*.yaml and more

if TYPE_CHECKING:
    from collections.abc import Callable

    from omegaconf import DictConfig

log = logging.getLogger("perfrun")

def _preflight(args: list[str]) -> tuple[str | None, DictConfig | None]:
    """Compose a single run's configuration, the one its job runs (with its ``hydra`` node),
    so that a wrong option, key or type gets one line instead of Hydra's page. Flags
    (``-m``, ``--cfg``...) and sweeps are left to Hydra, which reports those errors itself.

    Returns (the problem or None, the composed configuration or None)."""
    if any(a.startswith("-") for a in args):
        return None, None
    from hydra import compose, initialize_config_dir

    from perfrun.config import ConfigError
    from perfrun.telemetry.loggers import check

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            cfg = compose("train", overrides=args, return_hydra_config=True)
            run_dir = str(cfg.hydra.run.dir)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        return composition_error(e), None
    try:
        check(cfg.logger)
        from perfrun.validate import check_bounds

        check_bounds(cfg)
    except ConfigError as e:
        return str(e), None
    return _unwritable(Path(run_dir)), cfg


def _logger_problem(args: list[str]) -> str | None:
    """``logger=wandb`` (or a sweep over loggers) without its package: one line before any work."""
    from perfrun.telemetry.loggers import missing_package

    chosen = arg_value(args, "logger") or ""
    return next((m for m in map(missing_package, chosen.split(",")) if m), None)


def _multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a == "hydra.mode=MULTIRUN" for a in args)


# hydra/launcher options that hydra-submitit-launcher provides (submitit_*) or that build on it
SUBMITIT_LAUNCHERS = ("slurm", "slurm_local", "submitit_slurm", "submitit_local")


def _launcher_problem(args: list[str]) -> str | None:
    """``hydra/launcher=slurm`` without the plugin behind it, or a SLURM sweep where there
    is no SLURM: one line, where Hydra would print a page or a traceback (the preflight
    leaves ``-m`` to Hydra)."""
    import shutil

    chosen = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra/launcher=")]
    if not chosen or chosen[-1] not in SUBMITIT_LAUNCHERS:
        return None
    name = chosen[-1]
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ImportError:  # not even the hydra_plugins namespace: no Hydra plugin at all
        found = False
    if not found:
        return (f"hydra/launcher={name} needs the Hydra plugin hydra-submitit-launcher (it hands each job to "
                "SLURM, or to a local process, through submitit), which this Python lacks; "
                "install it with pip install 'perfrun[slurm]'")
    if _multirun(args) and name in ("slurm", "submitit_slurm") and shutil.which("srun") is None:
        return (f"hydra/launcher={name} submits the sweep's jobs to SLURM, but there is no srun on this "
                "machine's PATH (not a SLURM login node); run the sweep from one, or try it here first "
                "with hydra/launcher=slurm_local")
    return None


def _failed_jobs(in_process: list[str], sweep_dir: str | None) -> list[str]:
    """The sweep's failed jobs: those run in this process, or else those that the jobs'
    summary.json files in the sweep dir tell of, which is where a launcher that runs each
    job in another process (slurm, slurm_local) leaves them."""
    if in_process or sweep_dir is None:
        return in_process
    from perfrun.ladder.callback import failed_jobs

    return failed_jobs(Path(sweep_dir))


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name longer than the filesystem takes: it does not exist
        return False


def _unwritable(run_dir: Path) -> str | None:
    """Check, without creating it, that the run dir can be made: its nearest existing
    ancestor must be a folder we can write a file into."""
    import tempfile

    ancestor = run_dir.absolute()
    while not _exists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"hydra.run.dir={run_dir} cannot be created: {ancestor} is a file; choose another hydra.run.dir"
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    long = next((p for p in run_dir.parts if len(os.fsencode(p)) > name_max), None)
    if long is not None:
        return (f"hydra.run.dir: the folder name {long[:24]}... is {len(os.fsencode(long))} bytes, more than the "
                f"{name_max} this filesystem allows in a name; choose a shorter hydra.run.dir")
    try:
        with tempfile.TemporaryFile(dir=ancestor) as f:
            f.write(bytes(CONFIG_ROOM))  # room for the configuration Hydra saves before the job starts
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return (f"hydra.run.dir={run_dir}: the disk of {ancestor} is full (not even {CONFIG_ROOM // 1024} KiB free "
                    "for the run's configuration); free space there or choose a hydra.run.dir on another disk")
        return f"hydra.run.dir={run_dir} is not writable ({ancestor}: {e.strerror}); choose a writable hydra.run.dir"
    return None


def train_main(args: list[str]) -> int:
    """Run the Hydra app with ``args`` as its command line; with ``distributed=ddp
    nproc=N`` start torchrun instead, and under torchrun agree on the run dir first."""
    if any(a in COMPLETION_FLAGS for a in args):
        return shell_completion(args)
    if "--json" in args:
        return _train_json([a for a in args if a != "--json"])
    from perfrun.config import ConfigError, register_configs
    from perfrun.validate import validate

    args, given_root = take_search_root(args)
    register_configs()
    problem = _launcher_problem(args) or _logger_problem(args)
    if problem is not None:
        error(problem)
        return 2
    from perfrun.ladder import jobs as sweep_jobs

    problem, sweep_hydra = sweep_jobs.override_grammar(args), None
    if problem is None and _multirun(args):
        problem, sweep_hydra = sweep_jobs.preflight(args)
    elif problem is None:
        problem = sweep_jobs.preset_without_multirun(args)
    if problem is not None:
        error(problem)
        return 2
    problem, composed = _preflight(args)
    if problem is not None:
        error(problem)
        return 2
    world = world_size()
    try:
        config = typed(composed) if composed is not None else None
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            error(str(e))
        return 2
    except Exception as e:  # noqa: BLE001 - e.g. nproc=${hydra:launcher.gpus_per_node} outside a sweep job
        error(f"the configuration cannot be resolved here ({first_line(e, 10**6)}); ${{hydra:launcher...}} is known only "
              "in the jobs of a sweep (perfrun train -m hydra/launcher=slurm ...): give a number")
        return 2
    distributed = config.distributed if config is not None else arg_value(args, "distributed")
    nproc = config.nproc if config is not None else arg_value(args, "nproc")
    several = world > 1 or (distributed in PARALLEL and str(nproc).isdigit() and int(nproc) > 1)
    if config is not None:
        try:  # refused here, in a tenth of a second and before any run dir is made; several
            if several:  # processes: once, here, rather than once per rank
                validate_job(config, int(nproc) if world == 1 else None)
            else:
                validate(config)
        except ConfigError as e:
            if os.environ.get("RANK", "0") == "0":
                error(str(e))
            return 2
    if composed is not None and world == 1 and not _multirun(args):
        try:  # resume=auto from a new run dir: into the run it continues, before any rank starts
            redirect, run_dir = continue_run(composed)
        except ConfigError as e:
            error(str(e))
            return 2
        root = None if redirect else template_root(composed.hydra.run)  # a pinned run dir has none
        with undone_if_refused(run_dir):  # a refused job leaves a run dir that holds a run as it was
            if several:
                from perfrun.commands.hydra_app import with_hydra_overrides

                return launch_ranks(args + redirect, int(nproc), with_hydra_overrides(composed, redirect).hydra)
            return _run_composed(args + redirect, composed, redirect, root)
    if world == 1 and several and not _multirun(args):  # a sweep's jobs start their own torchrun
        return launch_ranks(args, int(nproc))
    if world > 1:
        if distributed not in PARALLEL:
            error(f"torchrun started {world} processes but distributed={distributed}; add distributed=ddp")
            return 2
        from perfrun import distributed as dist

        try:
            if composed is None:  # a flag (-m, --cfg): Hydra's own app, as in one process
                return _run_app(args + join_rank_group(args, config), given_root or _search_root(args))
            joined = join_rank_group(args, config, composed.hydra)  # the rank runs what it composed
            return _run_composed(args + joined, composed, joined, given_root or template_root(composed.hydra.run))
        finally:
            dist.destroy()
    if _multirun(args) or _answered_by_hydra(args):  # a sweep's root is read with its folder; no job, no root
        return _run_app(args, given_root, sweep_hydra)
    return _run_app(args, given_root or _search_root(args))


def _search_root(args: list[str]) -> Path | None:
    """Where ``resume=auto`` looks for the run a job continues: the fixed part of the run
    dir's template (the sweep dir's, in a sweep), read before perfrun pins the folders."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            hydra_cfg = compose("train", overrides=[a for a in args if a.startswith("hydra.")],
                                return_hydra_config=True).hydra
    except Exception:  # noqa: BLE001 - a bad hydra.* override: Hydra reports it itself
        return None
    return template_root(hydra_cfg.sweep if _multirun(args) else hydra_cfg.run)


def _train_json(args: list[str]) -> int:
    """``perfrun train --json ...``: the log on stderr, then on stdout the run's summary.json
    as one JSON object (a sweep: a list, one per job, in job order). The run dir is fixed
    here, before the run, so that it is found again whatever launches the jobs."""
    try:
        run_dir, sweep_dir = hydra_dirs(args)
    except Exception:  # noqa: BLE001 - the run reports what is wrong with the command line
        run_dir = sweep_dir = None
    if run_dir is not None and not _multirun(args):
        run_dir = _continued_dir(args, run_dir)
    pinned = args + (dir_overrides(run_dir, sweep_dir) if run_dir and sweep_dir else [])
    with contextlib.redirect_stdout(sys.stderr):
        code = train_main(pinned)
    if run_dir is None or sweep_dir is None or os.environ.get("RANK", "0") != "0":
        return code
    from perfrun.summary import SUMMARY_FILE, read_summary

    if _multirun(args):
        files = sorted(Path(sweep_dir).rglob(SUMMARY_FILE),
                       key=lambda p: [int(x) if x.isdigit() else x for x in p.relative_to(sweep_dir).parts])
        print(json.dumps([read_summary(f) for f in files], indent=2))
    elif (Path(run_dir) / SUMMARY_FILE).is_file():
        print(json.dumps(read_summary(Path(run_dir)), indent=2))
    return code


def _continued_dir(args: list[str], run_dir: str) -> str | None:
    """``resume=auto`` from a new run dir: the run dir of the run it continues, as the plain
    command finds it (:func:`perfrun.commands.resume_target.continue_run`), else ``run_dir``; the job is pinned to it and
    its summary printed from there. None where several runs could be meant: the run,
    unpinned, refuses with the line the plain command gives."""
    if arg_value(args, "resume") != "auto":
        return run_dir
    from perfrun.config import ConfigError

    _, composed = _preflight(args)
    if composed is None:  # the run itself says what is wrong
        return run_dir
    try:
        redirect, found = continue_run(composed)
    except ConfigError:
        return None
    return str(found) if redirect else run_dir


def _contents(run_dir: Path) -> str:
    return ", ".join(p.name + ("/" if p.is_dir() else "") for p in sorted(run_dir.iterdir())
                     if not p.name.startswith("."))


def _answered_by_hydra(args: list[str]) -> bool:
    """Hydra's flags that it answers without running a job (--help, --cfg, --info...)."""
    return any(a in HYDRA_ANSWERS or a.startswith(("--cfg=", "--info=")) for a in args)


def _run_app(args: list[str], search_root: Path | None, sweep_hydra: DictConfig | None = None) -> int:
    """The Hydra app, with ``args`` as its command line: Hydra composes the configuration
    (once per job of a sweep); ``search_root``: where ``resume=auto`` looks for the run a
    job continues (None: nowhere but the job's own run dir; in a sweep, the fixed part of
    the sweep dir's template); ``sweep_hydra``: a sweep's ``hydra`` node where the caller
    has composed it already (its first job's, which holds the sweep's folders)."""
    from perfrun.commands.hydra_app import run_hydra
    from perfrun.config import register_configs

    register_configs()
    failed: list[str] = []  # the sweep's jobs that failed in this process
    sweep_dir = None
    if _multirun(args):  # resolved once, here, so that the sweep's jobs can be read back from it
        try:
            node = sweep_hydra if sweep_hydra is not None else hydra_node(args)
            sweep_dir = str(node.sweep.dir)
            search_root = search_root or template_root(node.sweep)  # read before the sweep dir is pinned
            args = [*args, f"hydra.sweep.dir={quoted(sweep_dir)}"]
        except Exception:  # noqa: BLE001 - a bad hydra.* override: Hydra reports it just below
            sweep_dir = None
    from perfrun.ladder.jobs import stops_cleanly

    with stops_cleanly(sweep_dir):
        run_hydra("train", args, _app(args, search_root, failed))
    failed = _failed_jobs(failed, sweep_dir)
    if failed:
        error(f"{len(failed)} job(s) of the sweep failed: " + "; ".join(failed))
        return 1
    return 0


def _run_composed(args: list[str], composed: DictConfig, redirect: list[str], search_root: Path | None) -> int:
    """A plain run of the configuration the preflight composed (``args``: its command line,
    ``redirect``: hydra.* overrides decided since, applied to it as Hydra applies an override:
    the resume=auto run dir, or a rank's folders and quiet logging), through Hydra's own job
    machinery, so that it is not composed again."""
    from perfrun.commands.hydra_app import run_composed, with_hydra_overrides
    from perfrun.ladder.jobs import stops_cleanly

    with stops_cleanly(None):
        run_composed("train", with_hydra_overrides(composed, redirect), _app(args, search_root, []))
    return 0


def _app(args: list[str], search_root: Path | None, failed: list[str]) -> Callable[[DictConfig], None]:
    """The job Hydra calls with each configuration: a sweep job's failure is added to
    ``failed``; a single run's ends the process (SystemExit) with its exit code."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from perfrun.checkpoint.resume_search import RunSearch, job_config
    from perfrun.config import ConfigError
    from perfrun.memory.found_batches import FoundBatches

    found = FoundBatches()  # a sweep's repeats of one job reuse its batch search (batch_size=auto)

    def app(cfg: DictConfig) -> None:
        # the trainer (and torch) is imported by a job, never by --help, --cfg or --info
        from perfrun.loop.run import RunFailed, run
        from perfrun.loop.stopping import Interrupted
        from perfrun.telemetry.sinks import shown_path

        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        overrides = list(hc.overrides.task)
        try:
            config = typed(cfg)  # the job's configuration, typed once; cfg stays as Hydra composed it
            if hc.mode == RunMode.MULTIRUN:
                if _measured_before(config, run_dir, overrides):
                    return
                config = _breakdown_in_repeat_0(_with_planned_budget(config, Path(hc.sweep.dir)))
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
            else:
                log.info(f"run dir {shown_path(run_dir)}")
                search = RunSearch(search_root, job_config(cfg), run_dir) if search_root is not None else None
                try:
                    if config.ablation.rung:
                        from perfrun.ladder.rungs import run_rung

                        run_rung(config, run_dir, overrides=overrides, search=search, sweep_args=args,
                                 decision=decision, found=found)
                    else:
                        run(config, run_dir, overrides=overrides, search=search, sweep_args=args, found=found)
                finally:
                    log.info(f"run dir {shown_path(run_dir)}: {_contents(run_dir)}")
        except (ConfigError, RunFailed) as e:
            error(str(e))
            if hc.mode == RunMode.MULTIRUN:
                failed.append(f"job {hc.job.num} ({' '.join(overrides)}): {e}")
                return
            raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
        except Interrupted as e:
            error(str(e))
            raise SystemExit(e.exit_code) from None  # a stop request ends the sweep too

    return app


def _measured_before(cfg: TrainConfig, run_dir: Path, overrides: list[str]) -> bool:
    """A sweep job with ``resume=auto`` that the sweep dir already holds measured: True, with a
    log line, and the job is not run again."""
    from perfrun.ladder.jobs import already_measured

    if cfg.resume != "auto":
        return False
    status = already_measured(run_dir, overrides)
    if status is not None:
        log.info(f"resume=auto: job {run_dir.name} is already {status} in {run_dir}; kept, not run again")
    return status is not None


def _with_planned_budget(cfg: TrainConfig, sweep_dir: Path) -> TrainConfig:
    """The job with the time budget the sweep's calibration gives its rung kind in
    ``ablation.budget_s``, unless the command line set one."""
    from perfrun.ladder.plan import budget_for

    planned = budget_for(sweep_dir, cfg) if cfg.ablation.budget_s is None else None
    if planned is None:
        return cfg
    log.info(f"rung {cfg.ablation.rung or '?'}: measured within a {planned[0]:g} s budget ({planned[1]})")
    return replace(cfg, ablation=replace(cfg.ablation, budget_s=planned[0]))


def _breakdown_in_repeat_0(cfg: TrainConfig) -> TrainConfig:
    """A ladder rung's memory breakdown (one step under torch's memory tracker, seconds on a
    CPU) is taken in its repeat 0 only: one step's memory is the same in every repeat, and
    the report reads each rung's breakdown from the jobs that have one."""
    if not (cfg.memory.breakdown and cfg.ablation.rung and cfg.repeat > 0):
        return cfg
    log.info(f"rung {cfg.ablation.rung}: memory breakdown taken in repeat 0 (one step's memory is the same in every "
             "repeat)")
    return replace(cfg, memory=replace(cfg.memory, breakdown=False))


def shell_completion(args: list[str]) -> int:
    """Hydra's ``-sc install=bash`` or ``-sc query=bash``: Hydra composes the configuration
    and answers before calling the app, so this app imports nothing of the trainer."""
    from perfrun.commands.hydra_app import run_hydra
    from perfrun.config import register_configs

    register_configs()

    def complete(cfg: DictConfig) -> None:
        raise SystemExit(f"perfrun: error: {' '.join(args)} is not a shell-completion command")

    run_hydra("train", args, complete)
    return 0


main = train_main
