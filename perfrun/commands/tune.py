"""``perfrun tune [overrides] [tune.KEY=VALUE | flags]``: the configuration with the highest tokens/s, measured.

Not the largest batch that fits: the fastest one. Each trial is a short run of the real
trainer (:func:`perfrun.loop.run.run`, progress off) in its own dir under the tune dir, and
its figure is the median tokens/s over the steps after ``tune.warmup`` (so compile time and
the first allocations stay out). The search is greedy, one knob at a time, so it costs a
handful of trials rather than the grid:

1. **batch**: checkpointing none, eager, the first ``tune.workers`` option; batch sizes
   doubling from ``tune.start`` (or ``tune.batch_sizes``) until a trial fails (out of memory,
   more than the data holds) or tokens/s has not grown by more than ``tune.min_gain`` for
   ``tune.patience`` sizes in a row.
2. **checkpointing** (each other option): it recomputes activations, so at a batch that
   fits without it, it is slower. Its ladder starts at the first batch that failed in 1;
   if none failed, one trial at the best batch measures what it costs.
3. **compile** (if searched): on the best so far, a ladder from its batch upward (compiled
   code can use less memory and so fit more).
4. **workers** (each other option): one trial at the best.

The winner is the fastest completed trial of all, unless a trial within ``tune.min_gain``
of it (inside the noise) turns on fewer knobs: then that one, since a difference the noise
can make is no reason to add a knob; a trial that shared the machine (contended) wins only
if every trial did. Any searched key given on the command
line (``dataloader.batch_size=16``, ``checkpointing=full``, ``compile=true``,
``dataloader.num_workers=2``) is held fixed. The trials measure: they save no checkpoints
unless the command line asks (``checkpoint.at_end=true``, ``checkpoint.every_n_steps=N``).
:func:`search` takes the trial as a callable, so tests plant the figures.

The command is a Hydra app (conf/tune.yaml, keys typed by :mod:`perfrun.tune.config`):
the tune dir is its run dir, with ``.hydra/`` and the trials' log lines in ``tune.log``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perfrun.tune.config import (
    TuneConfig,
    TuneError,
    default_workers,
    flags_to_overrides,
    override_value,
    register_tune_schema,
)
from perfrun.tune.search import Candidate, Space, TrialResult, TuneResult, search

if TYPE_CHECKING:
    from perfrun.config import TrainConfig

SEARCHED = ("dataloader.batch_size", "checkpointing", "compile", "dataloader.num_workers")
TRIAL_KEYS = ("max_steps", "timing_warmup_steps", "log_every", "eval_every", "eval_batches", "progress",
              "monitor.every_n_steps")
# A trial measures; it keeps no checkpoint unless the command line sets one of these keys.
NO_CHECKPOINTS = {"checkpoint.at_end": "false", "checkpoint.every_n_steps": "0"}
__all__ = ["Candidate", "Space", "TrialResult", "TuneError", "TuneResult", "default_workers", "main", "search"]


# ------------------------------------------------------------------------------- real trials


class TrainTrial:
    """``trial(candidate)``: a short run of the trainer in ``out_dir/N``; see the module doc."""

    def __init__(self, overrides: Sequence[str], out_dir: Path, steps: int, warmup: int,
                 no_checkpoints: Sequence[str] = ()) -> None:
        self.overrides = list(overrides)
        self.out_dir = out_dir
        self.settings = [f"max_steps={steps}", f"timing_warmup_steps={warmup}", f"log_every={steps}",
                         "eval_every=0", "eval_batches=1", "progress=off", f"monitor.every_n_steps={steps}",
                         "memory.breakdown=true", *no_checkpoints]
        self.count = 0

    def compose(self, candidate: Candidate) -> TrainConfig:
        """The trial's configuration, composed once and typed (ConfigError for a key perfrun lacks)."""
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from perfrun.config import config_dir, register_configs, typed

        overrides = [*self.overrides, *candidate.overrides(), *self.settings]
        if GlobalHydra.instance().is_initialized():  # inside the tune's Hydra app, which searches conf/
            return typed(compose("train", overrides=overrides))
        register_configs()
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="tune"):
            return typed(compose("train", overrides=overrides))

    def __call__(self, candidate: Candidate) -> TrialResult:
        from perfrun.config import ConfigError
        from perfrun.loop.run import RunFailed, run

        run_dir = self.out_dir / str(self.count)
        self.count += 1
        t0 = time.perf_counter()
        try:
            cfg = self.compose(candidate)
            s = run(cfg, run_dir, overrides=[*self.overrides, *candidate.overrides(), *self.settings])
        except (ConfigError, RunFailed) as e:
            status = "oom" if "out of memory" in str(e) else "failed"
            return TrialResult(candidate, status, reason=str(e), run_dir=str(run_dir),
                               seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one broken point (an inductor crash, say) must not end the search
            first = (str(e).strip().splitlines() or [""])[0]
            return TrialResult(candidate, "failed", reason=f"{type(e).__name__}: {first}", run_dir=str(run_dir),
                               seconds=time.perf_counter() - t0)
        tps = s.get("tokens_per_s_median")
        return TrialResult(
            candidate, "completed" if tps is not None else "failed", tokens_per_s=tps,
            peak_mem_mib=s.get("peak_mem_mib"), step_time_ms=s.get("step_time_ms_median"),
            first_step_s=s.get("first_step_s"), run_dir=str(run_dir), seconds=time.perf_counter() - t0,
            contended=(s.get("contention") or {}).get("contended"),
            reason=None if tps is not None else "no steady step was timed; raise tune.steps (--steps) above tune.warmup",
        )


# ------------------------------------------------------------------------------- output


def command_line(winner: Candidate, overrides: Sequence[str]) -> str:
    """The override line to paste: the user's overrides and the winner's knobs."""
    return " ".join(["perfrun train", *overrides, *winner.overrides()])


def trials_table(result: TuneResult) -> Any:
    """Every trial, the winner starred, through the report's column specification."""
    from perfrun.report.columns import Column
    from perfrun.report.render import rich_table

    best = result.winner.tokens_per_s if result.winner else None
    number = {id(r): i for i, r in enumerate(result.trials)}
    columns = [
        Column("best", "", lambda r: r is result.winner, text=lambda r: "★" if r is result.winner else "",
               justify="left"),
        Column("trial", "#", lambda r: number[id(r)]),
        Column("phase", "phase", lambda r: r.phase, justify="left"),
        Column("batch", "batch", lambda r: r.candidate.batch_size),
        Column("checkpointing", "checkpointing", lambda r: r.candidate.checkpointing, justify="left"),
        Column("compile", "compile", lambda r: str(r.candidate.compile).lower(), justify="left"),
        Column("workers", "workers", lambda r: r.candidate.num_workers),
        Column("status", "status", lambda r: r.status, justify="left"),
        Column("tokens_per_s", "tok/s", lambda r: r.tokens_per_s, ",.0f"),
        Column("vs_best", "vs best", lambda r: r.tokens_per_s / best if (r.tokens_per_s and best) else None, ".2f"),
        Column("peak_mem_mib", "peak MiB", lambda r: r.peak_mem_mib, ",.0f"),
        Column("step_time_ms", "step ms", lambda r: r.step_time_ms, ".1f"),
        Column("first_step_s", "first step s", lambda r: r.first_step_s, ".2f"),
    ]
    return rich_table(columns, result.trials, lambda r: "best" if r is result.winner else (None if r.ok else "bad"),
                      title="perfrun tune: trials",
                      caption="★ highest tokens/s (median of the steady steps of each trial)")


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


def _searched(tc: TuneConfig) -> Space:
    """The options to search: tune's settings, or the default for each left null."""
    from perfrun.config import CHOICES

    for name in ("batch_sizes", "checkpointing", "compile", "workers"):
        if getattr(tc, name) == []:
            raise TuneError(f"tune.{name}=[] tries nothing; give at least one value, or null for the default")
    bad = [c for c in tc.checkpointing or [] if c not in CHOICES["checkpointing.name"]]
    if bad:
        raise TuneError(f"tune.checkpointing: {bad[0]} is not an option; choose from "
                        f"{', '.join(CHOICES['checkpointing.name'])}")
    if tc.workers is not None and min(tc.workers) < 0:
        raise TuneError(f"tune.workers={override_value(tc.workers)}: give whole numbers >= 0, e.g. [0,2]")
    quick = tc.quick
    return Space(
        checkpointing=tc.checkpointing or (["none"] if quick else ["none", "full"]),
        compile=tc.compile or ([False] if quick else [False, True]),
        num_workers=tc.workers or ([0] if quick else [0, default_workers()]),
        batch_sizes=tc.batch_sizes, start=tc.start, max_batch=tc.max_batch,
        patience=tc.patience, min_gain=tc.min_gain,
    )


def _space(tc: TuneConfig, fixed: dict[str, str]) -> Space:
    """The search space, with each searched key the command line gave held fixed."""
    space = _searched(tc)
    if "dataloader.batch_size" in fixed:
        b = fixed["dataloader.batch_size"]
        if not b.isdigit() or int(b) < 1:
            raise TuneError(f"dataloader.batch_size={b}: tune holds a given batch size fixed and needs a whole number >= 1 "
                            "(drop it to search batch sizes)")
        space.batch_sizes = [int(b)]
    if "checkpointing" in fixed:
        space.checkpointing = [fixed["checkpointing"]]
    if "compile" in fixed:
        if fixed["compile"].lower() not in ("true", "false"):
            raise TuneError(f"compile={fixed['compile']} must be true or false")
        space.compile = [fixed["compile"].lower() == "true"]
    if "dataloader.num_workers" in fixed:
        w = fixed["dataloader.num_workers"]
        if not w.isdigit():
            raise TuneError(f"dataloader.num_workers={w} must be a whole number >= 0")
        space.num_workers = [int(w)]
    if space.start < 1 or (space.max_batch is not None and space.max_batch < space.start):
        raise TuneError(f"--start {space.start} and --max-batch {space.max_batch}: need 1 <= start <= max-batch "
                        "(tune.start, tune.max_batch)")
    if space.batch_sizes is not None and min(space.batch_sizes) < 1:
        raise TuneError("--batch-sizes: every batch size must be >= 1 (tune.batch_sizes)")
    if space.patience < 1 or not space.min_gain >= 0:
        raise TuneError("--patience must be >= 1 and --min-gain >= 0 (tune.patience, tune.min_gain)")
    return space


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
    space = _space(tc, fixed)
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


@contextmanager
def kept_logging() -> Iterator[None]:
    """The root logger as it was: a Hydra app configures it for its job (a console handler,
    a log file in the job's dir), which a caller in the same process should not inherit."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:], root.level = handlers, level


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
