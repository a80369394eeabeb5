"""``perfrun tune [overrides] [tune.KEY=VALUE | flags]``: the configuration with the highest
tokens/s, measured by short runs of the real trainer (:mod:`perfrun.tune.trial`), searched
greedily one knob at a time (:mod:`perfrun.tune.search` says in which order and how the winner
is chosen). Any searched key given on the command line is held fixed; the trials save no
checkpoints unless the command line asks (``checkpoint.at_end=true``,
``checkpoint.every_n_steps=N``).

The command is a Hydra app (conf/tune.yaml, keys typed by :mod:`perfrun.tune.config`):
the tune dir is its run dir, with ``.hydra/`` and the trials' log lines in ``tune.log``.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perfrun.console import kept_logging
from perfrun.tune.config import (
    TuneConfig,
    TuneError,
    default_workers,
    flags_to_overrides,
    override_value,
    register_tune_schema,
)
from perfrun.tune.search import Candidate, Space, TrialResult, TuneResult, search
from perfrun.tune.space import space_for
from perfrun.tune.table import trials_table
from perfrun.tune.trial import NO_CHECKPOINTS, TrainTrial

if TYPE_CHECKING:
    pass

SEARCHED = ("dataloader.batch_size", "checkpointing", "compile", "dataloader.num_workers")
TRIAL_KEYS = ("max_steps", "timing_warmup_steps", "log_every", "eval_every", "eval_batches", "progress",
              "monitor.every_n_steps")
__all__ = ["Candidate", "Space", "TrialResult", "TuneError", "TuneResult", "default_workers", "main", "search"]


# ------------------------------------------------------------------------------- output


def command_line(winner: Candidate, overrides: Sequence[str]) -> str:
    """The override line to paste: the user's overrides and the winner's knobs."""
    return " ".join(["perfrun train", *overrides, *winner.overrides()])


# ------------------------------------------------------------------------------- command line

# Hydra's own flags that only show something (help, the composed config, completion):
# Hydra answers them, and no trial runs.
INSPECT = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-p", "--package", "--resolve",
           "-i", "--info", "-sc", "--shell-completion")


@dataclass
class TuneRequest:
    """A tune checked before any trial: what the command line asked for, composed and validated."""

    settings: TuneConfig
    overrides: list[str]  # the trainer's, without the searched keys: the start of the line to paste
    space: Space
    steps: int
    warmup: int
    out: Path
    no_checkpoints: list[str]  # what keeps the trials' checkpoints off ([] where the user asked for them)
    trial: Callable[[Candidate], TrialResult]


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _compose(args: list[str]) -> tuple[TuneConfig, Path]:
    """conf/tune.yaml composed with ``args``: tune's settings and the tune dir (its
    ``${now:...}`` read once, here); one line when it does not compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from perfrun.config import config_dir, register_configs
    from perfrun.console import composition_error

    register_configs()
    register_tune_schema()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="tune"):
            cfg = compose("tune", overrides=args, return_hydra_config=True)
            return OmegaConf.to_object(cfg.tune), Path(str(cfg.hydra.run.dir))  # type: ignore[return-value]
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        raise TuneError(composition_error(e, "tune")) from None


def _request(args: list[str], trial: Callable[[Candidate], TrialResult] | None) -> TuneRequest:
    """Everything checked before the first trial, so that a mistake is one line and costs nothing."""
    tc, out = _compose(args)
    steps = tc.steps if tc.steps is not None else (6 if tc.quick else 10)
    warmup = tc.warmup if tc.warmup is not None else (2 if tc.quick else 3)
    if warmup < 0 or steps <= warmup:
        raise TuneError(f"--steps {steps} must be more than --warmup {warmup} (tune.steps, tune.warmup: "
                        "the steps timed are the rest)")
    trainer = [a for a in args if not _key(a).startswith(("tune.", "hydra.", "hydra/"))]
    fixed: dict[str, str] = {}
    for o in trainer:
        if _key(o) in TRIAL_KEYS:
            raise TuneError(f"{o}: {_key(o)} is set by perfrun tune for its short trials; drop it "
                            "(use --steps and --warmup for the trial length)")
        if _key(o) in SEARCHED:
            fixed[_key(o)] = o.partition("=")[2]
    space = space_for(tc, fixed)
    overrides = [o for o in trainer if _key(o) not in SEARCHED]
    given = {_key(o) for o in trainer}
    no_checkpoints = [f"{k}={v}" for k, v in NO_CHECKPOINTS.items() if k not in given]
    if trial is None:
        trial = TrainTrial(overrides, out, steps, warmup, no_checkpoints)
        _preflight(trial, space)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TuneError(f"the tune dir {out} cannot be created ({e.strerror}); choose another --out (hydra.run.dir)") from None
    return TuneRequest(tc, overrides, space, steps, warmup, out, no_checkpoints, trial)


def _preflight(trial: TrainTrial, space: Space) -> None:
    """Compose and check the first candidate, so a bad override is one line before any trial."""
    from perfrun.config import ConfigError
    from perfrun.console import composition_error
    from perfrun.devices import resolve_device
    from perfrun.validate import validate

    first = Candidate(space.batch_sizes[0] if space.batch_sizes else space.start, space.checkpointing[0],
                      space.compile[0], space.num_workers[0])
    try:
        cfg = trial.compose(first)
        validate(cfg)
        resolve_device(cfg.device)
    except ConfigError as e:
        raise TuneError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors are the user's overrides
        raise TuneError(composition_error(e, "tune")) from None


def _tune(request: TuneRequest) -> int:
    """The search of ``request``: a line per trial, the table, tune_summary.json and the winner."""
    from rich.console import Console

    from perfrun.checkpoint.atomic import json_safe, write_json
    from perfrun.console import error, warn, wide_console

    console = Console(highlight=False, soft_wrap=True, stderr=request.settings.json)
    shown: list[TrialResult] = []

    def show(r: TrialResult) -> None:
        what = (f"{r.tokens_per_s:,.0f} tok/s" if r.ok else f"{r.status}: {r.reason}")
        console.print(f"trial {len(shown)}: [{r.phase}] {' '.join(r.candidate.overrides())} -> {what}", markup=False)
        shown.append(r)

    console.print(f"perfrun tune: {request.steps}-step trials ({request.warmup} warm-up) in {request.out}", markup=False)
    if len(request.no_checkpoints) == len(NO_CHECKPOINTS):
        console.print("perfrun tune: the trials save no checkpoints (they measure); add checkpoint.at_end=true "
                      "to keep them", markup=False)
    result = search(request.trial, request.space, show)
    winner = result.winner
    record: dict[str, Any] = {
        "overrides": request.overrides, "space": asdict(request.space), "steps": request.steps, "warmup": request.warmup,
        "trials": [{**asdict(r), "candidate": asdict(r.candidate)} for r in result.trials],
        "winner": asdict(winner.candidate) if winner else None,
        "command": command_line(winner.candidate, request.overrides) if winner else None,
        "dir": str(request.out),
    }
    if request.settings.json:
        sys.stdout.write(json.dumps(json_safe(record), indent=2, default=str) + "\n")
    else:
        table = trials_table(result)
        wide_console([table]).print(table)
    try:
        write_json(request.out / "tune_summary.json", record)
    except OSError as e:
        error(f"tune: cannot write {request.out / 'tune_summary.json'}: {e.strerror}")
    if winner is None:
        first = next((r.reason for r in result.trials if r.reason), "no trial ran")
        error(f"tune: every trial failed, so there is no winner; the first said: {first}")
        return 1
    if winner.contended:
        warn("tune: every trial shared the machine with other processes (contended), so this winner may reflect "
             "them as much as its knobs; rerun on a quiet machine")
    if not request.settings.json:
        console.print(f"best: {winner.tokens_per_s:,.0f} tok/s ({len(result.trials)} trials). Paste:", markup=False)
        console.print(command_line(winner.candidate, request.overrides), markup=False)
    return 0


def _run_app(args: list[str], request: TuneRequest | None) -> int:
    """The Hydra app with ``args`` as its command line: the tune of ``request`` in its run dir,
    or (no request) Hydra's answer to --help, --cfg and the like."""
    from perfrun.commands.hydra_app import hydra_main
    from perfrun.config import register_configs

    register_configs()
    register_tune_schema()
    with kept_logging():
        return hydra_main("tune", args, lambda _cfg: _tune(request) if request is not None else 0)


def main(argv: list[str], trial: Callable[[Candidate], TrialResult] | None = None) -> int:
    """``perfrun tune``: 0 with a winner, 1 when every trial failed, 2 on bad input."""
    from perfrun.console import error

    try:
        args = flags_to_overrides(list(argv))
        if any(a in INSPECT for a in args):
            return _run_app(args, None)
        for a in args:
            if a in ("-m", "--multirun"):
                raise TuneError(f"{a}: tune runs its trials itself, one after another; sweep with perfrun train -m")
            if a.startswith("-"):
                raise TuneError(f"unknown option {a}; perfrun tune --help lists tune's flags and keys")
        request = _request(args, trial)
    except TuneError as e:
        error(f"tune: {e}")
        return 2
    return _run_app([*args, f"hydra.run.dir={override_value(str(request.out))}"], request)
