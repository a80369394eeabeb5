"""``perfrun tune [options] [overrides]``: the configuration with the highest tokens/s, measured.

Not the largest batch that fits: the fastest one. Each trial is a short run of the real
trainer (:func:`perfrun.train.run`, progress off) in its own dir under the tune dir, and
its figure is the median tokens/s over the steps after ``--warmup`` (so compile time and
the first allocations stay out). The search is greedy, one knob at a time, so it costs a
handful of trials rather than the grid:

1. **batch**: checkpointing none, eager, the first ``--workers`` option; batch sizes
   doubling from ``--start`` (or ``--batch-sizes``) until a trial fails (out of memory,
   more than the data holds) or tokens/s has not grown by more than ``--min-gain`` for
   ``--patience`` sizes in a row.
2. **checkpointing** (each other option): it recomputes activations, so at a batch that
   fits without it, it is slower. Its ladder starts at the first batch that failed in 1;
   if none failed, one trial at the best batch measures what it costs.
3. **compile** (if searched): on the best so far, a ladder from its batch upward (compiled
   code can use less memory and so fit more).
4. **workers** (each other option): one trial at the best.

The winner is the fastest completed trial of all. Any searched key given on the command
line (``dataloader.batch_size=16``, ``checkpointing=full``, ``compile=true``,
``dataloader.num_workers=2``) is held fixed. :func:`search` takes the trial as a callable,
so tests plant the figures.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SEARCHED = ("dataloader.batch_size", "checkpointing", "compile", "dataloader.num_workers")
TRIAL_KEYS = ("max_steps", "timing_warmup_steps", "log_every", "eval_every", "eval_batches", "progress",
              "monitor.every_n_steps")


class TuneError(ValueError):
    """Bad input to ``perfrun tune``: one line, exit 2."""


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    batch_size: int
    checkpointing: str = "none"
    compile: bool = False
    num_workers: int = 0

    def overrides(self) -> list[str]:
        return [f"dataloader.batch_size={self.batch_size}", f"checkpointing={self.checkpointing}",
                f"compile={str(self.compile).lower()}", f"dataloader.num_workers={self.num_workers}"]


@dataclass
class TrialResult:
    """What one trial measured."""

    candidate: Candidate
    status: str  # completed | oom | failed
    tokens_per_s: float | None = None
    peak_mem_mib: float | None = None
    step_time_ms: float | None = None
    first_step_s: float | None = None
    reason: str | None = None
    run_dir: str | None = None
    phase: str = ""
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "completed" and self.tokens_per_s is not None


@dataclass
class Space:
    """What to search and how long to climb."""

    checkpointing: list[str] = field(default_factory=lambda: ["none", "full"])
    compile: list[bool] = field(default_factory=lambda: [False, True])
    num_workers: list[int] = field(default_factory=lambda: [0, default_workers()])
    batch_sizes: list[int] | None = None  # an explicit ladder; None: doubling from start
    start: int = 1
    max_batch: int | None = None
    patience: int = 1
    min_gain: float = 0.02  # a bigger batch must beat the best by this fraction to count as progress


@dataclass
class TuneResult:
    trials: list[TrialResult]
    winner: TrialResult | None


def default_workers() -> int:
    """The worker count worth trying on this machine: half its cores, one to four."""
    return min(4, max(1, (os.cpu_count() or 2) // 2))


def search(
    trial: Callable[[Candidate], TrialResult], space: Space,
    on_trial: Callable[[TrialResult], None] = lambda r: None,
) -> TuneResult:
    """The greedy search of the module doc; each candidate is tried at most once."""
    tried: dict[Candidate, TrialResult] = {}
    order: list[TrialResult] = []

    def measure(c: Candidate, phase: str) -> TrialResult:
        if c not in tried:
            r = trial(c)
            r.phase = phase
            tried[c] = r
            order.append(r)
            on_trial(r)
        return tried[c]

    def sizes(start: int) -> Iterator[int]:
        if space.batch_sizes is not None:
            yield from (b for b in sorted(set(space.batch_sizes)) if b >= start)
            return
        b = start
        while space.max_batch is None or b <= space.max_batch:
            yield b
            b *= 2

    def ladder(start: int, make: Callable[[int], Candidate], phase: str) -> tuple[TrialResult | None, int | None]:
        best: TrialResult | None = None
        misses = 0
        for b in sizes(start):
            r = measure(make(b), phase)
            if not r.ok:
                return best, b
            gained = best is None or r.tokens_per_s > best.tokens_per_s * (1 + space.min_gain)  # type: ignore[operator]
            if best is None or r.tokens_per_s > best.tokens_per_s:  # type: ignore[operator]
                best = r
            misses = 0 if gained else misses + 1
            if misses >= space.patience:
                break
        return best, None

    def leader() -> TrialResult | None:
        done = [r for r in order if r.ok]
        return max(done, key=lambda r: r.tokens_per_s) if done else None  # type: ignore[arg-type,return-value]

    ck0 = "none" if "none" in space.checkpointing else space.checkpointing[0]
    comp0 = False if False in space.compile else space.compile[0]
    w0 = space.num_workers[0]
    first = space.start if space.batch_sizes is None else min(space.batch_sizes)
    best1, fail1 = ladder(first, lambda b: Candidate(b, ck0, comp0, w0), "batch")
    for ck in (c for c in space.checkpointing if c != ck0):
        if fail1 is not None:
            ladder(fail1, lambda b, ck=ck: Candidate(b, ck, comp0, w0), "checkpointing")
        elif best1 is not None:
            measure(replace(best1.candidate, checkpointing=ck), "checkpointing")
    for comp in (c for c in space.compile if c != comp0):
        lead = leader()
        if lead is not None:
            base = lead.candidate
            ladder(base.batch_size, lambda b, base=base, comp=comp: replace(base, batch_size=b, compile=comp), "compile")
    for w in (w for w in space.num_workers if w != w0):
        lead = leader()
        if lead is not None:
            measure(replace(lead.candidate, num_workers=w), "workers")
    return TuneResult(order, leader())


# ------------------------------------------------------------------------------- real trials


class TrainTrial:
    """``trial(candidate)``: a short run of the trainer in ``out_dir/N``; see the module doc."""

    def __init__(self, overrides: Sequence[str], out_dir: Path, steps: int, warmup: int) -> None:
        self.overrides = list(overrides)
        self.out_dir = out_dir
        self.settings = [f"max_steps={steps}", f"timing_warmup_steps={warmup}", f"log_every={steps}",
                         "eval_every=0", "eval_batches=1", "progress=off", "monitor.every_n_steps=0"]
        self.count = 0

    def compose(self, candidate: Candidate) -> Any:
        from hydra import compose, initialize_config_dir

        from perfrun.config import config_dir, register_configs

        register_configs()
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="tune"):
            return compose("train", overrides=[*self.overrides, *candidate.overrides(), *self.settings])

    def __call__(self, candidate: Candidate) -> TrialResult:
        from perfrun.config import ConfigError
        from perfrun.train import RunFailed, run

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
            reason=None if tps is not None else "no steady step was timed; raise --steps above --warmup",
        )


# ------------------------------------------------------------------------------- output


def command_line(winner: Candidate, overrides: Sequence[str]) -> str:
    """The override line to paste: the user's overrides and the winner's knobs."""
    return " ".join(["perfrun train", *overrides, *winner.overrides()])


def trials_table(result: TuneResult) -> Any:
    from rich.table import Table

    t = Table(title="perfrun tune: trials", caption="★ highest tokens/s (median of the steady steps of each trial)",
              caption_justify="left")
    for name in ("", "#", "phase", "batch", "checkpointing", "compile", "workers", "status", "tok/s", "vs best",
                 "peak MiB", "step ms", "first step s"):
        t.add_column(name, justify="right" if name in ("#", "batch", "workers", "tok/s", "vs best", "peak MiB",
                                                       "step ms", "first step s") else "left")
    best = result.winner.tokens_per_s if result.winner else None

    def f(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    for i, r in enumerate(result.trials):
        c = r.candidate
        win = r is result.winner
        t.add_row("★" if win else "", str(i), r.phase, str(c.batch_size), c.checkpointing, str(c.compile).lower(),
                  str(c.num_workers), r.status, f(r.tokens_per_s, ",.0f"),
                  f(r.tokens_per_s / best if (r.tokens_per_s and best) else None, ".2f"),
                  f(r.peak_mem_mib, ",.0f"), f(r.step_time_ms, ".1f"), f(r.first_step_s, ".2f"),
                  style="bold green" if win else ("red" if not r.ok else None))
    return t


# ------------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise TuneError(f"{message} (perfrun tune --help)")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 0, e.g. 0,2")
    return values


def _bools(text: str) -> list[bool]:
    table = {"true": True, "false": False}
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not values or any(v not in table for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give false, true or false,true")
    return [table[v] for v in values]


def _names(text: str) -> list[str]:
    from perfrun.config import CHOICES

    values = [v.strip() for v in text.split(",") if v.strip()]
    allowed = CHOICES["checkpointing.name"]
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="perfrun tune",
        description="Search micro-batch size x checkpointing x compile x DataLoader workers for the highest "
                    "tokens/s, with short measured trials; ends with the override line to paste.",
        epilog="examples:\n  perfrun tune model=gpt2\n  perfrun tune --quick device=cpu\n"
               "  perfrun tune --batch-sizes 8,16,32 --compile false precision=bf16\n"
               "Any searched key given as an override (dataloader.batch_size, checkpointing, compile,\n"
               "dataloader.num_workers) is held fixed. Trials are kept under --out: perfrun report DIR.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="configuration overrides, as for perfrun train")
    p.add_argument("--quick", action="store_true",
                   help="batch size only (no checkpointing, eager, no workers) and shorter trials")
    p.add_argument("--steps", type=int, help="optimizer steps per trial (default 10; --quick 6)")
    p.add_argument("--warmup", type=int, help="first steps of a trial kept out of its figure (default 3; --quick 2)")
    p.add_argument("--batch-sizes", type=_ints, help="the batch sizes to climb, e.g. 4,8,16 (default: doubling)")
    p.add_argument("--start", type=int, default=1, help="first batch size of the doubling ladder (default 1)")
    p.add_argument("--max-batch", type=int, help="largest batch size to try")
    p.add_argument("--checkpointing", type=_names, help="options to try (default none,full)")
    p.add_argument("--compile", type=_bools, help="options to try (default false,true)")
    p.add_argument("--workers", type=_ints, help=f"DataLoader workers to try (default 0,{default_workers()})")
    p.add_argument("--patience", type=int, default=1, help="sizes without gain before a ladder stops (default 1)")
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="relative tokens/s gain that counts as progress (default 0.02)")
    p.add_argument("--out", help="where the trials go (default outputs/tune/DATE/TIME)")
    return p


def _space(args: argparse.Namespace, fixed: dict[str, str]) -> Space:
    quick = args.quick
    space = Space(
        checkpointing=args.checkpointing or (["none"] if quick else ["none", "full"]),
        compile=args.compile or ([False] if quick else [False, True]),
        num_workers=args.workers or ([0] if quick else [0, default_workers()]),
        batch_sizes=args.batch_sizes, start=args.start, max_batch=args.max_batch,
        patience=args.patience, min_gain=args.min_gain,
    )
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
        raise TuneError(f"--start {space.start} and --max-batch {space.max_batch}: need 1 <= start <= max-batch")
    if space.batch_sizes is not None and min(space.batch_sizes) < 1:
        raise TuneError("--batch-sizes: every batch size must be >= 1")
    if space.patience < 1 or not space.min_gain >= 0:
        raise TuneError("--patience must be >= 1 and --min-gain >= 0")
    return space


def main(argv: list[str], trial: Callable[[Candidate], TrialResult] | None = None) -> int:
    """``perfrun tune``: 0 with a winner, 1 when every trial failed, 2 on bad input."""
    from rich.console import Console

    from perfrun.atomic import write_json
    from perfrun.console import error as _error
    from perfrun.console import wide_console

    console = Console(highlight=False, soft_wrap=True)
    try:
        args = _parser().parse_intermixed_args(argv)
        steps = args.steps if args.steps is not None else (6 if args.quick else 10)
        warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
        if warmup < 0 or steps <= warmup:
            raise TuneError(f"--steps {steps} must be more than --warmup {warmup} (the steps timed are the rest)")
        overrides = list(args.overrides)
        fixed: dict[str, str] = {}
        for o in overrides:
            key, _, value = o.partition("=")
            key = key.lstrip("+~")
            if key in TRIAL_KEYS:
                raise TuneError(f"{o}: {key} is set by perfrun tune for its short trials; drop it "
                                "(use --steps and --warmup for the trial length)")
            if key in SEARCHED:
                fixed[key] = value
        space = _space(args, fixed)
        overrides = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in SEARCHED]
        out = Path(args.out) if args.out else Path("outputs/tune") / time.strftime("%Y-%m-%d/%H-%M-%S")
        if trial is None:
            trial = TrainTrial(overrides, out, steps, warmup)
            _preflight(trial, space)
    except TuneError as e:
        _error(f"tune: {e}")
        return 2

    def show(r: TrialResult) -> None:
        c = r.candidate
        what = (f"{r.tokens_per_s:,.0f} tok/s" if r.ok else f"{r.status}: {r.reason}")
        console.print(f"trial {len(shown)}: [{r.phase}] {' '.join(c.overrides())} -> {what}", markup=False)
        shown.append(r)

    shown: list[TrialResult] = []
    console.print(f"perfrun tune: {steps}-step trials ({warmup} warm-up) in {out}", markup=False)
    result = search(trial, space, show)
    table = trials_table(result)
    wide_console([table]).print(table)
    record: dict[str, Any] = {
        "overrides": overrides, "space": asdict(space), "steps": steps, "warmup": warmup,
        "trials": [{**asdict(r), "candidate": asdict(r.candidate)} for r in result.trials],
        "winner": asdict(result.winner.candidate) if result.winner else None,
        "command": command_line(result.winner.candidate, overrides) if result.winner else None,
    }
    try:
        write_json(out / "tune_summary.json", record)
    except OSError as e:
        _error(f"tune: cannot write {out / 'tune_summary.json'}: {e.strerror}")
    if result.winner is None:
        first = next((r.reason for r in result.trials if r.reason), "no trial ran")
        _error(f"tune: every trial failed, so there is no winner; the first said: {first}")
        return 1
    w = result.winner
    console.print(f"best: {w.tokens_per_s:,.0f} tok/s ({len(result.trials)} trials). Paste:", markup=False)
    console.print(command_line(w.candidate, overrides), markup=False)
    return 0


def _preflight(trial: TrainTrial, space: Space) -> None:
    """Compose and check the first candidate, so a bad override is one line before any trial."""
    from perfrun.config import ConfigError, validate
    from perfrun.console import first_line
    from perfrun.devices import resolve_device

    first = Candidate(space.batch_sizes[0] if space.batch_sizes else space.start, space.checkpointing[0],
                      space.compile[0], space.num_workers[0])
    try:
        cfg = trial.compose(first)
        validate(cfg)
        resolve_device(cfg.device)
    except ConfigError as e:
        raise TuneError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors are the user's overrides
        try:
            from perfrun.console import composition_error

            message = composition_error(e, "tune")
        except ImportError:
            message = first_line(e, 10**6)
        raise TuneError(message) from None
