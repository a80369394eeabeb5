"""Several processes per job: ``perfrun train distributed=ddp nproc=N`` starts torchrun,
a sweep job with ``nproc`` > 1 starts its own, and a rank started by torchrun joins its
group before Hydra so that every rank writes into the one run dir that rank 0 resolved.

``python -m perfrun.commands.launch TORCHRUN_ARGS`` is torchrun (``torch.distributed.run``) whose
failures read as the ranks' own one-line errors and exit code: torchrun itself reports a
failed rank with a page (ChildFailedError, its traceback and an error table) after the
rank has already printed its one line; :func:`main` keeps the rank's line and code and
drops the page. Everything else is torchrun's own code. torch is imported only where a
process is about to use it, so ``perfrun`` starts (and completes a Tab) without it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.config import config_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from perfrun.config import TrainConfig

# Ranks other than 0 write nothing and print only warnings and errors: no .hydra/, no
# log file, no sweep summary (rank 0 writes each once, into the folder all ranks share).
QUIET_RANK = [
    "hydra.output_subdir=null",
    "~hydra.job_logging.handlers.file",
    "hydra.job_logging.root.handlers=[console]",
    "hydra.job_logging.root.level=WARNING",
    "hydra.hydra_logging.root.level=WARNING",
    "~hydra.callbacks.sweep_summary",
]
# a sweep job's ranks are told where resume=auto searches (the sweep's folder) by this flag,
# which perfrun train takes off its command line before Hydra sees it
SEARCH_ROOT_FLAG = "--resume-search-root"


def arg_value(args: list[str], key: str) -> str | None:
    """The last ``key=value`` on the command line (the one Hydra applies)."""
    found = [a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")]
    return found[-1] if found else None


def quoted(value: str) -> str:
    """A string as a Hydra override value (quoted, so ``=``, ``,`` or spaces stay literal)."""
    return f"'{value}'" if "'" not in value else value


def hydra_node(args: list[str]) -> DictConfig:
    """The ``hydra`` node of the command line's configuration (of its hydra.* overrides alone
    where the whole line does not compose, as a sweep's a=1,2 does not): its folders."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import register_configs

    register_configs()
    plain = [a for a in args if not a.startswith("-")]
    hydra_only = [a for a in plain if a.startswith("hydra.")]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        if _sweeps(plain):  # a sweep's a=1,2 does not compose: no need to try
            return compose("train", overrides=hydra_only, return_hydra_config=True).hydra
        try:
            cfg = compose("train", overrides=plain, return_hydra_config=True)
        except Exception:  # noqa: BLE001 - the line does not compose; the dirs need only hydra.*
            cfg = compose("train", overrides=hydra_only, return_hydra_config=True)
        return cfg.hydra


def _sweeps(overrides: list[str]) -> bool:
    """Whether an override sweeps (a=1,2, range(...), ...), which no single composition takes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(overrides))
    except Exception:  # noqa: BLE001 - an override Hydra cannot read: the composition says so
        return False


def hydra_dirs(args: list[str], node: DictConfig | None = None) -> tuple[str, str]:
    """hydra.run.dir and hydra.sweep.dir resolved once, here: their ``${now:...}`` is read
    at this moment, so every process handed these strings writes into the same folder.
    ``node``: the ``hydra`` node of the configuration ``args`` composes, where the caller
    has it (else it is composed here)."""
    node = node if node is not None else hydra_node(args)
    return str(node.run.dir), str(node.sweep.dir)


def dir_overrides(run_dir: str, sweep_dir: str) -> list[str]:
    """The overrides that pin both folders to the values resolved by :func:`hydra_dirs`."""
    return [f"hydra.run.dir={quoted(run_dir)}", f"hydra.sweep.dir={quoted(sweep_dir)}"]


def validate_job(cfg: TrainConfig, launching: int | None = None) -> None:
    """The job's configuration, checked as run() will check it; ``launching``: as the ranks
    of the torchrun of that many processes about to start."""
    from dataclasses import replace

    from perfrun.validate import check_distributed, validate

    if launching:
        check_distributed(cfg, world=launching)
        cfg = replace(cfg, nproc=1)  # checked just above against the world it will have
    validate(cfg)


def take_search_root(args: list[str]) -> tuple[list[str], Path | None]:
    """``args`` without :data:`SEARCH_ROOT_FLAG`, and the folder it gives (None without it)."""
    prefix = f"{SEARCH_ROOT_FLAG}="
    given = [a.removeprefix(prefix) for a in args if a.startswith(prefix)]
    return [a for a in args if not a.startswith(prefix)], (Path(given[-1]) if given else None)


def run_torchrun(nproc: int, train_args: list[str]) -> int:
    """``perfrun train TRAIN_ARGS`` as ``nproc`` ranks of a local torchrun; its exit code.
    SIGTERM is passed on (torchrun forwards it to the ranks); Ctrl-C reaches the ranks
    directly, and they stop themselves, so this process just waits for them. The ranks
    print where this process prints: on stderr while ``perfrun train --json`` keeps
    stdout for the summary."""
    import subprocess

    cmd = [sys.executable, "-m", "perfrun.commands.launch", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "perfrun", "train", *train_args]
    proc = subprocess.Popen(cmd, stdout=sys.stderr if sys.stdout is sys.stderr else None)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_ranks(args: list[str], nproc: int, node: DictConfig | None = None) -> int:
    """``perfrun train distributed=ddp nproc=N``: start N ranks through torchrun, with the
    run dir (and sweep dir) resolved once here (from ``node``, the ``hydra`` node of the
    configuration ``args`` composes, where the caller has it) and handed to all of them."""
    return run_torchrun(nproc, [*args, *dir_overrides(*hydra_dirs(args, node))])


def run_sweep_job_on_ranks(cfg: TrainConfig, overrides: list[str], run_dir: Path, *, sweep_args: list[str],
                           search_root: Path | None) -> int:
    """A sweep job with ``nproc`` > 1: this job starts its own torchrun, whose ranks write
    into the job's folder (rank 0 its summary.json, which the sweep summary reads). So a
    sweep can vary nproc and distributed, and each job can go to a cluster node whole.
    The ranks see a single run, so the job's logger names (its sweep's group, from the
    sweep's command line ``sweep_args``) and where ``resume=auto`` searches go with them."""
    from perfrun.checkpoint.atomic import write_json
    from perfrun.config import ConfigError
    from perfrun.telemetry.loggers import sweep_job_names

    def no_summary(status: str, reason: str) -> None:  # the job's row in the sweep summary
        write_json(run_dir / "summary.json", {"status": status, "reason": reason, "overrides": overrides})

    try:
        validate_job(cfg, launching=int(cfg.nproc))
    except ConfigError as e:
        no_summary("failed", str(e))
        raise
    names = [f"{key}={quoted(value)}" for key, value in sweep_job_names(cfg, run_dir, sweep_args).items()]
    root = [f"{SEARCH_ROOT_FLAG}={search_root}"] if search_root is not None else []
    code = run_torchrun(int(cfg.nproc), [*_resolved(overrides, cfg), *names, f"hydra.run.dir={quoted(str(run_dir))}",
                                         "hydra.output_subdir=null", *root])
    if code != 0 and not (run_dir / "summary.json").exists():  # the ranks died before writing one
        no_summary("interrupted" if code in (130, 143) else "failed",
                   f"its {cfg.nproc} ranks exited with code {code} before writing a summary; "
                   f"see {run_dir / 'train.log'} and the console")
    return code


def _resolved(overrides: list[str], cfg: TrainConfig) -> list[str]:
    """The job's overrides for its torchrun, with interpolations replaced by their values in
    this job: ``nproc=${hydra:launcher.gpus_per_node}`` means this job's launcher, which
    the ranks (composing with Hydra's basic launcher) do not have."""
    from perfrun.config import select

    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not ("${" in value or "$\\{" in value) or key.startswith(("~", "hydra")):  # as typed, or as Hydra escapes it
            out.append(override)
            continue
        v = select(cfg, key.lstrip("+"))
        if isinstance(v, bool) or v is None:
            out.append(f"{key}={'null' if v is None else str(v).lower()}")
        elif isinstance(v, int | float):
            out.append(f"{key}={v}")
        elif isinstance(v, str):
            out.append(f"{key}={quoted(v)}")
        else:
            out.append(override)
    return out


def join_rank_group(args: list[str], cfg: TrainConfig | None, node: DictConfig | None = None) -> list[str]:
    """Under torchrun: make the process group now, before Hydra, so that rank 0 can hand
    every rank its run dir (read from ``node``, the ``hydra`` node the rank composed, where
    it has one); ranks other than 0 are quietened. Returns the extra overrides."""
    import torch

    from perfrun import distributed

    cpu = str(cfg.device if cfg is not None else arg_value(args, "device")) == "cpu"
    distributed.init_from_env("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    dirs: tuple[str, str] | None = None
    if distributed.rank() == 0:
        try:
            dirs = hydra_dirs(args, node)
        except Exception:  # noqa: BLE001 - reported below, on every rank, instead of a hang
            dirs = None
    dirs = distributed.from_rank0(dirs)
    if dirs is None:
        raise SystemExit("perfrun: error: rank 0 could not resolve hydra.run.dir; run perfrun train --cfg hydra")
    return dir_overrides(*dirs) + (QUIET_RANK if distributed.rank() != 0 else [])


def main(argv: list[str] | None = None) -> int:
    """torchrun with the ranks' own one-line failure (see the module's docstring)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in ("torch.distributed", "torch.distributed.run"):  # its OMP_NUM_THREADS banner
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure page
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal before it could say why
            name = signal.Signals(-failure.exitcode).name
            print(f"perfrun: error: rank {rank} was killed by {name}", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as e:  # torchrun was stopped; it has forwarded the signal to the ranks
        return 128 + int(e.sigval)
    return 0


def world_size() -> int:
    """The number of processes torchrun started for this job (1 when it did not)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    import gc

    try:
        raise SystemExit(main())
    finally:
        gc.freeze()  # no last full collection over torch's objects at exit (see perfrun.__main__)
