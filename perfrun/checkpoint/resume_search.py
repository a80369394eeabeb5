"""``resume=auto`` from a new run dir: find the run it continues under the outputs folder.

A run is the same job when its configuration (``.hydra/config.yaml``, written when it
started) equals this one's, leaving out ``resume`` itself, ``max_steps`` (raised to train
further) and the keys that change what is shown or kept, not what is trained
(:data:`IGNORED`). Of those runs, the one with a checkpoint short of ``max_steps`` is
continued; several such runs are ambiguous and refused; a run already at ``max_steps`` is
refused with the fix, since a second run of it would train nothing new.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from perfrun.checkpoint.names import list_checkpoints
from perfrun.config import ConfigError

IGNORED = ("resume", "max_steps", "progress", "log_every", "monitor", "logger", "mfu", "timing_warmup_steps",
           "checkpoint", "profile", "profiler", "memory_snapshot", "memory", "hydra")
_STEP = re.compile(r"step_(\d+)")
_SHOWN = 3  # ambiguous runs named in the refusal


def job_config(composed: DictConfig) -> str:
    """The configuration that decides what is trained, as a comparable string: taken from
    the composed configuration as Hydra writes it (.hydra/config.yaml, interpolations kept),
    before setup finds out what the data turned out to be."""
    tree = OmegaConf.to_container(composed, resolve=False)
    assert isinstance(tree, dict)
    return json.dumps({k: v for k, v in tree.items() if k not in IGNORED}, sort_keys=True, default=str)


def search_root(run_dir_template: str) -> Path | None:
    """The folder that holds the run dirs: ``outputs`` of ``outputs/${now:...}/${now:...}``;
    None for a run dir named in full (no interpolation: nothing else to search)."""
    if "${" not in run_dir_template:
        return None
    prefix = run_dir_template.split("${", 1)[0]
    return Path(prefix if prefix.endswith("/") else Path(prefix).parent or ".")


@dataclass
class RunSearch:
    """Where ``resume=auto`` looks when the job's own folder holds no checkpoint."""

    root: Path
    config: str  # job_config() of the job, taken before setup fills in what the data turned out to be
    run_dir: Path | None  # the job's own run dir, left out of the search


@dataclass
class SavedRun:
    """A run of this configuration under the outputs folder, and its newest checkpoint."""

    run_dir: Path
    checkpoint: Path
    step: int


def _candidates(root: Path, config: str, exclude: Path | None) -> list[SavedRun]:
    found = []
    for saved in sorted(root.glob("**/.hydra/config.yaml")):
        run_dir = saved.parent.parent
        if exclude is not None and run_dir.absolute() == exclude.absolute():
            continue
        ckpts = list_checkpoints(run_dir / "checkpoints")
        if not ckpts:
            continue
        try:
            same = job_config(OmegaConf.load(saved)) == config
        except Exception:  # noqa: BLE001 - an unreadable config is not this job's
            continue
        if same:
            found.append(SavedRun(run_dir, ckpts[-1], int(_STEP.search(ckpts[-1].name).group(1))))
    return sorted(found, key=lambda c: c.checkpoint.stat().st_mtime)


def find_run(search: RunSearch, max_steps: int) -> SavedRun | None:
    """The run that ``resume=auto`` continues, None when there is none; ConfigError when
    several could be meant or the only one is already at ``max_steps``."""
    root = search.root
    if not root.is_dir():
        return None
    found = _candidates(root, search.config, search.run_dir)
    unfinished = [c for c in found if c.step < max_steps]
    if len(unfinished) > 1:
        shown = ", ".join(f"{c.run_dir} (step {c.step})" for c in unfinished[-_SHOWN:][::-1])
        raise ConfigError(
            f"resume=auto: {len(unfinished)} runs under {root} have this configuration and a checkpoint to continue "
            f"({shown}{', ...' if len(unfinished) > _SHOWN else ''}); choose one with hydra.run.dir=RUN_DIR resume=auto"
        )
    if unfinished:
        return unfinished[0]
    if found:
        last = found[-1]
        raise ConfigError(
            f"resume=auto: the run in {last.run_dir} with this configuration is already at step {last.step} "
            f"(max_steps={max_steps}); raise max_steps to train it further, or start a new run without resume"
        )
    return None
