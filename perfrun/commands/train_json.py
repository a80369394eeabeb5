"""``perfrun train --json ...``: the run's summary.json on stdout, the log on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from perfrun.commands.launch import arg_value, dir_overrides, hydra_dirs
from perfrun.commands.resume_target import continue_run
from perfrun.commands.train_preflight import multirun, preflight


def train_json(args: list[str], train_main: Callable[[list[str]], int]) -> int:
    """``perfrun train --json ...``: the log on stderr, then on stdout the run's summary.json
    as one JSON object (a sweep: a list, one per job, in job order). The run dir is fixed
    here, before the run, so that it is found again whatever launches the jobs."""
    try:
        run_dir, sweep_dir = hydra_dirs(args)
    except Exception:  # noqa: BLE001 - the run reports what is wrong with the command line
        run_dir = sweep_dir = None
    if run_dir is not None and not multirun(args):
        run_dir = continued_dir(args, run_dir)
    pinned = args + (dir_overrides(run_dir, sweep_dir) if run_dir and sweep_dir else [])
    with contextlib.redirect_stdout(sys.stderr):
        code = train_main(pinned)
    if run_dir is None or sweep_dir is None or os.environ.get("RANK", "0") != "0":
        return code
    from perfrun.summary import SUMMARY_FILE, read_summary

    if multirun(args):
        files = sorted(Path(sweep_dir).rglob(SUMMARY_FILE),
                       key=lambda p: [int(x) if x.isdigit() else x for x in p.relative_to(sweep_dir).parts])
        print(json.dumps([read_summary(f) for f in files], indent=2))
    elif (Path(run_dir) / SUMMARY_FILE).is_file():
        print(json.dumps(read_summary(Path(run_dir)), indent=2))
    return code


def continued_dir(args: list[str], run_dir: str) -> str | None:
    """``resume=auto`` from a new run dir: the run dir of the run it continues, as the plain
    command finds it (:func:`perfrun.commands.resume_target.continue_run`), else ``run_dir``; the job is pinned to it and
    its summary printed from there. None where several runs could be meant: the run,
    unpinned, refuses with the line the plain command gives."""
    if arg_value(args, "resume") != "auto":
        return run_dir
    from perfrun.config import ConfigError

    _, composed = preflight(args)
    if composed is None:  # the run itself says what is wrong
        return run_dir
    try:
        redirect, found = continue_run(composed)
    except ConfigError:
        return None
    return str(found) if redirect else run_dir
