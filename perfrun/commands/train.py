"""``perfrun train``: the command line checked (one line for a mistake), then one of four
paths, each Hydra's own ``hydra.main`` over conf/train.yaml with the command line: one run
(its run dir found first, for ``resume=auto``, and pinned), a sweep (``-m``), a rank under
torchrun (the run dir agreed with the other ranks first), or Hydra's own flags (``--help``,
``--cfg``, ``--info``, and a flag-led line). A single run's configuration is composed here,
with Hydra's compose API, to check it (a setting the device refuses too) and find its run
dir, then by ``hydra.main`` for the job (which composes once for the mode, once for the
job). What several processes need (torchrun, one run dir for every rank) is in
:mod:`perfrun.commands.launch`; the job Hydra calls is :mod:`perfrun.commands.train_job`.
Hydra's completion script calls ``perfrun -sc query=bash`` with the whole line in
COMP_LINE; the dispatcher (:mod:`perfrun.commands.dispatch`) removes the ``train`` word from
it, since Hydra knows no subcommands, and the answer is composed without importing the
trainer (no torch), so a Tab is quick.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.checkpoint.run_lock import undone_if_refused
from perfrun.commands.launch import (
    arg_value,
    hydra_node,
    join_rank_group,
    launch_ranks,
    quoted,
    take_search_root,
    validate_job,
    world_size,
)
from perfrun.commands.resume_target import continue_run, template_root
from perfrun.commands.train_job import PARALLEL, hydra_task
from perfrun.commands.train_preflight import command_line_problem, failed_jobs, multirun, preflight
from perfrun.config import TrainConfig, config_dir, typed
from perfrun.console import error, first_line

COMPLETION_FLAGS = ("-sc", "--shell-completion")
HYDRA_ANSWERS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info")  # no job runs

if TYPE_CHECKING:
    from collections.abc import Callable

    from omegaconf import DictConfig


class Refused(Exception):
    """A configuration refused before any job: rank 0 prints its one line, the exit code is 2."""


def train_main(args: list[str]) -> int:
    """``perfrun train ARGS``: the exit code."""
    if any(a in COMPLETION_FLAGS for a in args):
        return shell_completion(args)
    if "--json" in args:
        from perfrun.commands.train_json import train_json

        return train_json([a for a in args if a != "--json"], train_main)
    from perfrun.config import register_configs

    args, given_root = take_search_root(args)
    register_configs()
    problem, sweep_hydra = command_line_problem(args)
    if problem is None:
        problem, composed = preflight(args)
    if problem is not None:
        error(problem)
        return 2
    try:
        config = _checked(composed, args)
    except Refused as e:
        if os.environ.get("RANK", "0") == "0":
            error(str(e))
        return 2
    if world_size() > 1:
        return _rank(args, composed, config, given_root)
    if multirun(args):
        return _sweep(args, given_root, sweep_hydra)
    nproc = config.nproc if config is not None else arg_value(args, "nproc")
    if composed is None:
        return _hydra_flags(args, given_root, int(nproc) if _several(config, args) else None)
    return _one_run(args, composed, int(nproc) if _several(config, args) else None)


def _several(config: TrainConfig | None, args: list[str]) -> bool:
    """Whether the job runs on several processes: under torchrun, or asked to start them."""
    distributed = config.distributed if config is not None else arg_value(args, "distributed")
    nproc = config.nproc if config is not None else arg_value(args, "nproc")
    return world_size() > 1 or (distributed in PARALLEL and str(nproc).isdigit() and int(nproc) > 1)


def _checked(composed: DictConfig | None, args: list[str]) -> TrainConfig | None:
    """The composed configuration typed and validated, here, before any run dir is made; a
    single run's setting that its device refuses too; several processes: once, here, rather
    than once per rank."""
    from perfrun.config import ConfigError
    from perfrun.validate import validate

    if composed is None:
        return None
    try:
        config = typed(composed)
    except ConfigError as e:
        raise Refused(str(e)) from None
    except Exception as e:  # noqa: BLE001 - e.g. nproc=${hydra:launcher.gpus_per_node} outside a sweep job
        raise Refused(f"the configuration cannot be resolved here ({first_line(e, 10**6)}); ${{hydra:launcher...}} is "
                      "known only in the jobs of a sweep (perfrun train -m hydra/launcher=slurm ...): give a number") \
            from None
    try:
        if _several(config, args):
            validate_job(config, int(config.nproc) if world_size() == 1 else None)
        else:  # one process: what setup would refuse before building anything, refused before the run dir
            from perfrun.devices import resolve_device
            from perfrun.loop.refusals import refuse_before_building

            validate(config)
            refuse_before_building(config, resolve_device(config.device))
    except ConfigError as e:
        raise Refused(str(e)) from None
    return config


def _one_run(args: list[str], composed: DictConfig, nproc: int | None) -> int:
    """One run: ``resume=auto`` from a new run dir goes into the run it continues; the run dir
    is pinned, so that the second composition (Hydra's) writes where the first looked; with
    ``nproc`` ranks, torchrun starts them."""
    from perfrun.config import ConfigError

    try:
        redirect, run_dir = continue_run(composed)
    except ConfigError as e:
        error(str(e))
        return 2
    root = None if redirect else template_root(composed.hydra.run)  # a pinned run dir has none
    pinned = redirect or [f"hydra.run.dir={quoted(str(run_dir))}"]
    with undone_if_refused(run_dir):  # a refused job leaves a run dir that holds a run as it was
        if nproc is not None:
            return launch_ranks(args + redirect, nproc, None if redirect else composed.hydra)
        return _run_app(args + pinned, root)


def _rank(args: list[str], composed: DictConfig | None, config: TrainConfig | None, given_root: Path | None) -> int:
    """A rank under torchrun: the process group first, so that rank 0 hands every rank its
    run dir, then the job (or Hydra's answer to a flag) as in one process."""
    distributed = config.distributed if config is not None else arg_value(args, "distributed")
    if distributed not in PARALLEL:
        error(f"torchrun started {world_size()} processes but distributed={distributed}; add distributed=ddp")
        return 2
    from perfrun import distributed as dist

    try:
        if composed is None:  # a flag (-m, --cfg): Hydra's own app, as in one process
            return _run_app(args + join_rank_group(args, config), given_root or _search_root(args))
        joined = join_rank_group(args, config, composed.hydra)
        return _run_app(args + joined, given_root or template_root(composed.hydra.run))
    finally:
        dist.destroy()


def _sweep(args: list[str], given_root: Path | None, sweep_hydra: DictConfig | None) -> int:
    """``-m``: the sweep dir resolved once, here, so that the jobs can be read back from it;
    ``resume=auto`` searches the fixed part of its template; a job that fails is counted, and
    the sweep's exit code says whether any did."""
    from perfrun.ladder.jobs import stops_cleanly

    sweep_dir, search_root = None, given_root
    try:
        node = sweep_hydra if sweep_hydra is not None else hydra_node(args)
        sweep_dir = str(node.sweep.dir)
        search_root = search_root or template_root(node.sweep)  # read before the sweep dir is pinned
        args = [*args, f"hydra.sweep.dir={quoted(sweep_dir)}"]
    except Exception:  # noqa: BLE001 - a bad hydra.* override: Hydra reports it just below
        sweep_dir = None
    failed: list[str] = []  # the sweep's jobs that failed in this process
    with stops_cleanly(sweep_dir):
        _hydra("train", args, hydra_task(args, search_root, failed))
    failed = failed_jobs(failed, sweep_dir)
    if failed:
        error(f"{len(failed)} job(s) of the sweep failed: " + "; ".join(failed))
        return 1
    return 0


def _hydra_flags(args: list[str], given_root: Path | None, nproc: int | None) -> int:
    """Hydra's own flags (``--cfg``, ``--help``, ``--info``, ...), answered without a job; any
    other flag runs the job Hydra composes, on ``nproc`` ranks where asked."""
    if nproc is not None:
        return launch_ranks(args, nproc)
    if _answered_by_hydra(args):
        return _run_app(args, given_root)
    return _run_app(args, given_root or _search_root(args))


def _run_app(args: list[str], search_root: Path | None) -> int:
    """A single job through ``hydra.main`` with ``args`` as its command line; ``search_root``:
    where ``resume=auto`` looks for the run a job continues (None: nowhere but its own run dir)."""
    from perfrun.ladder.jobs import stops_cleanly

    with stops_cleanly(None):
        _hydra("train", args, hydra_task(args, search_root, []))
    return 0


def _hydra(name: str, args: list[str], task: Callable[[DictConfig], None]) -> None:
    from perfrun.commands.hydra_app import run_hydra

    run_hydra(name, args, task)


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
    return template_root(hydra_cfg.sweep if multirun(args) else hydra_cfg.run)


def _answered_by_hydra(args: list[str]) -> bool:
    """Hydra's flags that it answers without running a job (--help, --cfg, --info...)."""
    return any(a in HYDRA_ANSWERS or a.startswith(("--cfg=", "--info=")) for a in args)


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
