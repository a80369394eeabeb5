"""Which run ``perfrun train ... resume=auto`` continues, found before the job starts (and
before any rank does): the run of the same configuration under the folder that holds the run
dirs, when the job's own run dir holds no checkpoint. The search itself is
:mod:`perfrun.checkpoint.resume_search`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.commands.launch import quoted
from perfrun.console import stderr_console

if TYPE_CHECKING:
    from omegaconf import DictConfig


def continue_run(composed: DictConfig) -> tuple[list[str], Path]:
    """``resume=auto`` where the run dir holds no checkpoint (a new timestamped folder): the
    ``hydra.run.dir`` of the run with this configuration under the outputs folder, so that
    the job continues it and writes into it (no override when there is none); and the run
    dir the job will write into."""
    from perfrun.checkpoint.names import list_checkpoints
    from perfrun.checkpoint.resume_search import RunSearch, find_run, job_config

    run_dir = Path(str(composed.hydra.run.dir))
    if composed.resume != "auto" or composed.checkpoint.dir:
        return [], run_dir
    root = template_root(composed.hydra.run)
    if root is None or list_checkpoints(run_dir / "checkpoints"):
        return [], run_dir
    found = find_run(RunSearch(root, job_config(composed), run_dir), int(composed.max_steps))
    if found is None:
        return [], run_dir
    stderr_console().print(f"resume=auto: continuing the run in {found.run_dir} from step {found.step}", markup=False)
    return [f"hydra.run.dir={quoted(str(found.run_dir))}"], found.run_dir


def template_root(node: DictConfig) -> Path | None:
    """The fixed part of ``node.dir``'s template (hydra.run or hydra.sweep): where
    ``resume=auto`` looks for the run a job continues."""
    from omegaconf import OmegaConf

    from perfrun.checkpoint.resume_search import search_root

    return search_root(str(OmegaConf.to_container(node, resolve=False)["dir"]))
