"""What ``perfrun train`` checks before any job starts, each mistake as one line: the
launcher and logger the command line names are installed, a sweep's overrides parse, a
single run's configuration composes and is within bounds, and its run dir can be made."""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.commands.launch import arg_value
from perfrun.config import config_dir
from perfrun.console import composition_error

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_ROOM = 64 * 1024  # bytes a run dir must take before the job starts: Hydra's .hydra/*.yaml and more


def command_line_problem(args: list[str]) -> tuple[str | None, DictConfig | None]:
    """What is wrong with the command line before anything composes (a missing plugin or
    logger package, an override that does not parse, a sweep's jobs that do not compose),
    and a sweep's ``hydra`` node where its check composed it."""
    from perfrun.ladder import jobs as sweep_jobs

    problem = launcher_problem(args) or logger_problem(args) or sweep_jobs.override_grammar(args)
    if problem is not None:
        return problem, None
    if multirun(args):
        return sweep_jobs.preflight(args)
    return sweep_jobs.preset_without_multirun(args), None


def preflight(args: list[str]) -> tuple[str | None, DictConfig | None]:
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
    return unwritable(Path(run_dir)), cfg


def logger_problem(args: list[str]) -> str | None:
    """``logger=wandb`` (or a sweep over loggers) without its package: one line before any work."""
    from perfrun.telemetry.loggers import missing_package

    chosen = arg_value(args, "logger") or ""
    return next((m for m in map(missing_package, chosen.split(",")) if m), None)


def multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a == "hydra.mode=MULTIRUN" for a in args)


# hydra/launcher options that hydra-submitit-launcher provides (submitit_*) or that build on it
SUBMITIT_LAUNCHERS = ("slurm", "slurm_local", "submitit_slurm", "submitit_local")


def launcher_problem(args: list[str]) -> str | None:
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
    if multirun(args) and name in ("slurm", "submitit_slurm") and shutil.which("srun") is None:
        return (f"hydra/launcher={name} submits the sweep's jobs to SLURM, but there is no srun on this "
                "machine's PATH (not a SLURM login node); run the sweep from one, or try it here first "
                "with hydra/launcher=slurm_local")
    return None


def failed_jobs(in_process: list[str], sweep_dir: str | None) -> list[str]:
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


def unwritable(run_dir: Path) -> str | None:
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
