"""The greedy search of ``perfrun tune``: the candidates, the trials' results, and
:func:`search`, which takes the trial as a callable, so tests plant the figures.

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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from perfrun.tune.config import default_workers


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    batch_size: int
    checkpointing: str = "none"
    compile: bool = False
    num_workers: int = 0

    def knobs(self) -> int:
        """How many knobs it turns on beyond plain training: fewer wins a tie."""
        return (self.checkpointing != "none") + bool(self.compile) + (self.num_workers > 0)

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
    contended: bool | None = None  # the trial shared the machine (summary contention)

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
    return TuneResult(order, winner(order, space.min_gain))


def winner(trials: list[TrialResult], noise: float) -> TrialResult | None:
    """The fastest trial, unless another within ``noise`` (a fraction) of it turns on fewer
    knobs: a difference inside the noise is no reason to add a knob. Contended trials (that
    shared the machine) never win while another did not."""
    done = [r for r in trials if r.ok and not r.contended] or [r for r in trials if r.ok]
    if not done:
        return None
    fastest = max(r.tokens_per_s for r in done)  # type: ignore[type-var]
    near = [r for r in done if r.tokens_per_s >= fastest * (1 - noise)]  # type: ignore[operator]
    return min(near, key=lambda r: (r.candidate.knobs(), -r.tokens_per_s))  # type: ignore[operator]
