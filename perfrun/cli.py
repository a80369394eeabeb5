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

COMMANDS = {
    "train": "train a GPT with the knobs you choose (a Hydra app: perfrun train --help)",
    "gpu-check": "diagnose this machine and measure what it can do",
    "report": "the table and plot of runs or sweeps, after the fact (perfrun report PATH...)",
    "tune": "search batch size, checkpointing, compile and workers for the highest tokens/s",
    "generate": "sample text from a checkpoint with a KV cache, and measure what the cache buys",
    "export": "write a checkpoint as ONNX or safetensors (with the Hugging Face GPT-2 layout)",
}
_FAILED_JOBS: list[str] = []


def config_dir() -> str:
    """Where the YAML lives: inside the installed package, or conf/ of a source checkout."""
    spec = importlib.util.find_spec("perfrun.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "train.yaml").is_file():
        return str(checkout)
    raise SystemExit("perfrun: error: the configuration (conf/train.yaml) is missing from this install; reinstall perfrun")


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


def _error(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]perfrun: error:[/] {message}", markup=True)


def _one_line(exc: BaseException) -> str:
    """Hydra's composition errors, as one line: what was wrong and how to fix it."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group = exc.missing_cfg_file.rsplit("/", 1)[0] if exc.missing_cfg_file else "the group"
        wrong = exc.missing_cfg_file.rsplit("/", 1)[-1] if exc.missing_cfg_file else "?"
        return f"{group}={wrong} is not an option of {group}; choose one of {', '.join(exc.options)}"
    text = str(exc).strip()
    cause = exc.__cause__
    if text.startswith("Could not override"):
        key = text.split("'")[1] if "'" in text else text
        return (f"{key} is not a key of the configuration; list the keys with perfrun train --cfg job "
                "(a misspelt group or key is the usual cause)")
    if text.startswith("Error merging override") and cause is not None:
        override = text.removeprefix("Error merging override").strip()
        reason = str(cause).strip().splitlines()[0]
        return f"{override}: {reason}; give a value of the type the key takes (perfrun train --cfg job shows them)"
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"{first} (perfrun train --help lists the groups and options)"


def _preflight(args: list[str]) -> str | None:
    """Compose a single run's configuration before Hydra does, so that a wrong option,
    key or type gets one line instead of Hydra's page. Flags (``-m``, ``--cfg``...) and
    sweeps are left to Hydra, which reports those errors itself."""
    if any(a.startswith("-") for a in args):
        return None
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            cfg = compose("train", overrides=args, return_hydra_config=True)
            run_dir = str(cfg.hydra.run.dir)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        return _one_line(e)
    return _unwritable(Path(run_dir))


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
    """Run the Hydra app with ``args`` as its command line."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from perfrun.config import ConfigError, register_configs
    from perfrun.guards import Interrupted
    from perfrun.train import RunFailed, run

    register_configs()
    problem = _preflight(args)
    if problem is not None:
        _error(problem)
        return 2

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
    def app(cfg: DictConfig) -> None:
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        overrides = list(hc.overrides.task)
        try:
            run(cfg, run_dir, overrides=overrides)
        except (ConfigError, RunFailed) as e:
            _error(str(e))
            if hc.mode == RunMode.MULTIRUN:
                _FAILED_JOBS.append(f"job {hc.job.num} ({' '.join(overrides)}): {e}")
                return
            raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
        except Interrupted as e:
            _error(str(e))
            raise SystemExit(e.exit_code) from None  # a stop request ends the sweep too

    saved = sys.argv
    sys.argv = ["perfrun"] + args
    _FAILED_JOBS.clear()
    try:
        app()
    finally:
        sys.argv = saved
    if _FAILED_JOBS:
        _error(f"{len(_FAILED_JOBS)} job(s) of the sweep failed: " + "; ".join(_FAILED_JOBS))
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
    if command == "gpu-check":
        from perfrun.gpucheck import main as gpucheck_main

        return gpucheck_main(rest)
    if command == "report":
        from perfrun.report import main as report_main

        return report_main(rest)
    if command == "tune":
        from perfrun.tune import main as tune_main

        return tune_main(rest)
    if command == "generate":
        from perfrun.generate import main as generate_main

        return generate_main(rest)
    if command == "export":
        from perfrun.export import main as export_main

        return export_main(rest)
    _error(f"unknown command {command!r}; the commands are {', '.join(COMMANDS)} (perfrun --help)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
