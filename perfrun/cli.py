"""``perfrun COMMAND ...``: dispatch to the Hydra trainer, gpu-check and report.

``perfrun train`` hands the rest of the command line to a real Hydra app, so ``-m``,
``--cfg job``, ``--help``, ``--info`` and shell completion all work. Hydra's completion
script calls ``perfrun -sc query=bash`` with the whole line in COMP_LINE; the
``train`` word is removed from it here, since Hydra knows no subcommands.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from perfrun.config import config_dir
from perfrun.console import composition_error, error, first_line

COMMANDS = {
    "train": "train a GPT with the knobs you choose (a Hydra app: perfrun train --help)",
    "gpu-check": "diagnose this machine and measure what it can do",
    "report": "the table and plot of runs or sweeps, after the fact (perfrun report PATH...)",
    "tune": "search batch size, checkpointing, compile and workers for the highest tokens/s",
    "generate": "sample text from a checkpoint with a KV cache, and measure what the cache buys",
    "export": "write a checkpoint as ONNX or safetensors (with the Hugging Face GPT-2 layout)",
    "prepare": "tokenise a corpus into train.bin/val.bin for data=memmap (a Hydra app: perfrun prepare --help)",
}
# The other commands: each module's main(argv) -> exit code, imported only when used.
_MODULES = {"gpu-check": "perfrun.gpucheck", "report": "perfrun.report", "tune": "perfrun.tune",
            "generate": "perfrun.generate", "export": "perfrun.export", "prepare": "perfrun.prepare"}
_FAILED_JOBS: list[str] = []
PARALLEL = ("ddp", "fsdp")  # the distributed= values that run one process per GPU


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: perfrun COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        "examples:",
        "  perfrun train                                  # the built-in default: tiny GPT on Python's own source",
        "  perfrun train precision=bf16 compile=true",
        "  perfrun train -m dataloader.batch_size=8,16,32 dataloader.num_workers=0,2,4",
        "  perfrun gpu-check",
        "",
        "shell completion:  eval \"$(perfrun train -sc install=bash)\"",
    ]
    return "\n".join(lines)


def _preflight(args: list[str]) -> tuple[str | None, Any]:
    """Compose a single run's configuration before Hydra does, so that a wrong option,
    key or type gets one line instead of Hydra's page. Flags (``-m``, ``--cfg``...) and
    sweeps are left to Hydra, which reports those errors itself.

    Returns (the problem or None, the composed configuration or None)."""
    if any(a.startswith("-") for a in args):
        return None, None
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            cfg = compose("train", overrides=args, return_hydra_config=True)
            run_dir = str(cfg.hydra.run.dir)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        return composition_error(e), None
    return _unwritable(Path(run_dir)), cfg


def validate_job(composed: Any, launching: int | None = None) -> None:
    """The job's configuration without Hydra's own node, checked as run() will check it;
    ``launching``: as the ranks of the torchrun of that many processes about to start."""
    from omegaconf import OmegaConf

    from perfrun.config import check_distributed, validate

    job = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
    if launching:
        job.nproc = 1  # checked just below against the world it will have
        check_distributed(composed, world=launching)
    validate(job)


def _arg_value(args: list[str], key: str) -> str | None:
    """The last ``key=value`` on the command line (the one Hydra applies)."""
    found = [a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")]
    return found[-1] if found else None


def _hydra_dirs(args: list[str]) -> tuple[str, str]:
    """hydra.run.dir and hydra.sweep.dir resolved once, here: their ``${now:...}`` is read
    at this moment, so every rank handed these strings writes into the same folder."""
    from hydra import compose, initialize_config_dir

    plain = [a for a in args if not a.startswith("-")]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        try:
            cfg = compose("train", overrides=plain, return_hydra_config=True)
        except Exception:  # noqa: BLE001 - a sweep's a=1,2 does not compose; the dirs need only hydra.*
            cfg = compose("train", overrides=[a for a in plain if a.startswith("hydra.")], return_hydra_config=True)
        return str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)


def _quoted(value: str) -> str:
    """A path as a Hydra override value (quoted, so ``=``, ``,`` or spaces stay literal)."""
    return f"'{value}'" if "'" not in value else value


def _dir_overrides(run_dir: str, sweep_dir: str) -> list[str]:
    return [f"hydra.run.dir={_quoted(run_dir)}", f"hydra.sweep.dir={_quoted(sweep_dir)}"]


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


def _torchrun(nproc: int, train_args: list[str]) -> int:
    """``perfrun train TRAIN_ARGS`` as ``nproc`` ranks of a local torchrun; its exit code.
    SIGTERM is passed on (torchrun forwards it to the ranks); Ctrl-C reaches the ranks
    directly, and they stop themselves, so this process just waits for them."""
    import signal
    import subprocess

    cmd = [sys.executable, "-m", "perfrun.launch", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "perfrun", "train", *train_args]
    proc = subprocess.Popen(cmd)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch_torchrun(args: list[str], nproc: int) -> int:
    """``perfrun train distributed=ddp nproc=N``: start N ranks through torchrun, with the
    run dir (and sweep dir) resolved once here and handed to all of them."""
    return _torchrun(nproc, [*args, *_dir_overrides(*_hydra_dirs(args))])


def _torchrun_job(cfg: Any, overrides: list[str], run_dir: Path) -> int:
    """A sweep job with ``nproc`` > 1: this job starts its own torchrun, whose ranks write
    into the job's folder (rank 0 its summary.json, which the sweep summary reads). So a
    sweep can vary nproc and distributed, and each job can go to a cluster node whole."""
    from perfrun.atomic import write_json
    from perfrun.config import ConfigError

    def no_summary(status: str, reason: str) -> None:  # the job's row in the sweep summary
        write_json(run_dir / "summary.json", {"status": status, "reason": reason, "overrides": overrides})

    try:
        validate_job(cfg, launching=int(cfg.nproc))
    except ConfigError as e:
        no_summary("failed", str(e))
        raise
    code = _torchrun(int(cfg.nproc), [*_resolved(overrides, cfg), f"hydra.run.dir={_quoted(str(run_dir))}",
                                      "hydra.output_subdir=null"])
    if code != 0 and not (run_dir / "summary.json").exists():  # the ranks died before writing one
        no_summary("interrupted" if code in (130, 143) else "failed",
                   f"its {cfg.nproc} ranks exited with code {code} before writing a summary; "
                   f"see {run_dir / 'train.log'} and the console")
    return code


def _resolved(overrides: list[str], cfg: Any) -> list[str]:
    """The job's overrides for its torchrun, with interpolations replaced by their values in
    this job: ``nproc=${hydra:launcher.gpus_per_node}`` means this job's launcher, which
    the ranks (composing with Hydra's basic launcher) do not have."""
    from omegaconf import OmegaConf

    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not ("${" in value or "$\\{" in value) or key.startswith(("~", "hydra")):  # as typed, or as Hydra escapes it
            out.append(override)
            continue
        v = OmegaConf.select(cfg, key.lstrip("+"))
        if isinstance(v, bool) or v is None:
            out.append(f"{key}={'null' if v is None else str(v).lower()}")
        elif isinstance(v, int | float):
            out.append(f"{key}={v}")
        elif isinstance(v, str):
            out.append(f"{key}={_quoted(v)}")
        else:
            out.append(override)
    return out


def _join_torchrun(args: list[str], composed: Any) -> list[str]:
    """Under torchrun: make the process group now, before Hydra, so that rank 0 can hand
    every rank its run dir; ranks other than 0 are quietened. Returns the extra overrides."""
    import torch

    from perfrun import distributed

    cpu = str(composed.device if composed is not None else _arg_value(args, "device")) == "cpu"
    distributed.init_from_env("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    dirs: tuple[str, str] | None = None
    if distributed.rank() == 0:
        try:
            dirs = _hydra_dirs(args)
        except Exception:  # noqa: BLE001 - reported below, on every rank, instead of a hang
            dirs = None
    dirs = distributed.from_rank0(dirs)
    if dirs is None:
        raise SystemExit("perfrun: error: rank 0 could not resolve hydra.run.dir; run perfrun train --cfg hydra")
    return _dir_overrides(*dirs) + (QUIET_RANK if distributed.rank() != 0 else [])


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
    from perfrun.sweep import failed_jobs

    return failed_jobs(Path(sweep_dir))


def _unwritable(run_dir: Path) -> str | None:
    """Check, without creating it, that the run dir can be made: its nearest existing
    ancestor must be a folder we can write a file into."""
    import tempfile

    ancestor = run_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"hydra.run.dir={run_dir} cannot be created: {ancestor} is a file; choose another hydra.run.dir"
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        return f"hydra.run.dir={run_dir} is not writable ({ancestor}: {e.strerror}); choose a writable hydra.run.dir"
    return None


def train_main(args: list[str]) -> int:
    """Run the Hydra app with ``args`` as its command line; with ``distributed=ddp
    nproc=N`` start torchrun instead, and under torchrun agree on the run dir first."""
    from perfrun.config import ConfigError, check_distributed, register_configs

    register_configs()
    launcher = _launcher_problem(args)
    if launcher is not None:
        error(launcher)
        return 2
    problem, composed = _preflight(args)
    if problem is not None:
        error(problem)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        distributed = composed.distributed if composed is not None else _arg_value(args, "distributed")
        nproc = composed.nproc if composed is not None else _arg_value(args, "nproc")
    except Exception as e:  # noqa: BLE001 - e.g. nproc=${hydra:launcher.gpus_per_node} outside a sweep job
        error(f"distributed or nproc cannot be resolved here ({first_line(e, 10**6)}); ${{hydra:launcher...}} is known only in "
               "the jobs of a sweep (perfrun train -m hydra/launcher=slurm ...): give a number")
        return 2
    several = world > 1 or (distributed in PARALLEL and str(nproc).isdigit() and int(nproc) > 1)
    if composed is not None:
        try:  # several processes: refuse a bad value once, here, rather than once per rank
            if several:
                validate_job(composed, int(nproc) if world == 1 else None)
            else:
                check_distributed(composed)
        except ConfigError as e:
            if os.environ.get("RANK", "0") == "0":
                error(str(e))
            return 2
    if world == 1 and several and not _multirun(args):  # a sweep's jobs start their own torchrun
        return _launch_torchrun(args, int(nproc))
    if world > 1:
        if distributed not in PARALLEL:
            error(f"torchrun started {world} processes but distributed={distributed}; add distributed=ddp")
            return 2
        from perfrun import distributed as dist

        try:
            return _run_app(args + _join_torchrun(args, composed))
        finally:
            dist.destroy()
    return _run_app(args)


def _run_app(args: list[str]) -> int:
    """The Hydra app, with ``args`` as its command line."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from perfrun.config import ConfigError
    from perfrun.guards import Interrupted
    from perfrun.train import RunFailed, run

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
    def app(cfg: DictConfig) -> None:
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        overrides = list(hc.overrides.task)
        try:
            if cfg.distributed in PARALLEL and cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
                code = _torchrun_job(cfg, overrides, run_dir)
                if code in (130, 143):  # the ranks were stopped by a signal: so is the sweep
                    raise SystemExit(code)
                if code != 0:  # the ranks have printed why
                    raise RunFailed(f"its {cfg.nproc} ranks exited with code {code}; see {run_dir / 'train.log'}")
            else:
                run(cfg, run_dir, overrides=overrides)
        except (ConfigError, RunFailed) as e:
            error(str(e))
            if hc.mode == RunMode.MULTIRUN:
                _FAILED_JOBS.append(f"job {hc.job.num} ({' '.join(overrides)}): {e}")
                return
            raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
        except Interrupted as e:
            error(str(e))
            raise SystemExit(e.exit_code) from None  # a stop request ends the sweep too

    sweep_dir = None
    if _multirun(args):  # resolved once, here, so that the sweep's jobs can be read back from it
        try:
            sweep_dir = _hydra_dirs(args)[1]
            args = [*args, f"hydra.sweep.dir={_quoted(sweep_dir)}"]
        except Exception:  # noqa: BLE001 - a bad hydra.* override: Hydra reports it just below
            sweep_dir = None
    saved = sys.argv
    sys.argv = ["perfrun"] + args
    _FAILED_JOBS.clear()
    try:
        app()
    finally:
        sys.argv = saved
    _FAILED_JOBS[:] = _failed_jobs(list(_FAILED_JOBS), sweep_dir)
    if _FAILED_JOBS:
        error(f"{len(_FAILED_JOBS)} job(s) of the sweep failed: " + "; ".join(_FAILED_JOBS))
        return 1
    return 0


def _complete_subcommand() -> int | None:
    """Shell completion: strip the subcommand from COMP_LINE, or complete the subcommand."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if len(words) >= 2 and words[1] == "train" and (len(words) > 2 or line.endswith(" ")):
        os.environ["COMP_LINE"] = line.replace(" train", "", 1)
        return None
    prefix = words[1] if len(words) >= 2 and not line.endswith(" ") else ""
    print(" ".join(c for c in COMMANDS if c.startswith(prefix)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from perfrun import __version__

        print(f"perfrun {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("-sc", "--shell-completion"):
        if any(a.startswith("query=") for a in rest):
            done = _complete_subcommand()
            if done is not None:
                return done
        return train_main(argv)
    if command == "train":
        return train_main(rest)
    if command in _MODULES:
        import importlib

        return importlib.import_module(_MODULES[command]).main(rest)
    error(f"unknown command {command!r}; the commands are {', '.join(COMMANDS)} (perfrun --help)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
