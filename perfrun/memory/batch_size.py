"""``dataloader.batch_size=auto`` and ``perfrun estimate``'s largest batch: one search for the
largest batch that fits, started where the memory estimates say, then verified.

**Search** (:func:`search`). From a starting batch, gallop: while the batch fits, try
``lo + 1, lo + 3, lo + 7, ...`` (from 1 this is doubling), while it does not, ``hi - 1, hi - 3,
...``, until a batch that fits and one that does not bracket the answer; then bisect. Each
batch is tried once. ``fits(batch) -> bool`` is either an estimate against a limit
(:func:`largest_batch`, for ``perfrun estimate``: nothing runs) or a real training step
(:class:`~perfrun.memory.trial.StepTrial`, for ``batch_size=auto``); raising
``torch.OutOfMemoryError`` counts as "does not fit". The chosen batch is the largest that
fitted shrunk by the safety margin, ``floor(max_fit * (1 - margin))``, because the real run is
not the trial: the allocator fragments, and evaluation and data workers take memory of their
own. A search stopped by the cap (``dataloader.max_batch_size``, or the number of training
sequences) is not shrunk: nothing showed that batch to be near the limit.

**Start** (:func:`line_start`). A step's peak grows about linearly in the batch, so the
straight line through the estimated peaks at batches 1 and 2 meets the limit near the answer;
the search starts there, so it brackets the answer near the guess and never estimates (or
tries) a batch far past what fits. ``batch_size=auto`` takes the line's batch from estimates
and lets real trials do the rest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from perfrun.config import ConfigError, DataLoaderConfig, TrainConfig
from perfrun.knobs import Plan, compilation
from perfrun.memory.estimate import EstimateError, estimate
from perfrun.memory.trial import MIB, StepOf, StepTrial, release

log = logging.getLogger("perfrun")


class NoBatchFits(RuntimeError):
    """Not even the smallest batch fitted."""

    def __init__(self, trials: list[tuple[int, bool]]) -> None:
        super().__init__(f"no batch size fits (trials: {trials})")
        self.trials = trials


@dataclass
class SearchResult:
    """What the search found; ``batch_size`` is the one to use."""

    batch_size: int
    max_fit: int  # the largest batch that fitted
    first_fail: int | None  # the smallest batch that did not; None: stopped by the cap
    cap: int | None
    margin: float
    trials: list[tuple[int, bool]] = field(default_factory=list)  # (batch, fitted) in order


def search(
    fits: Callable[[int], bool], *, start: int = 1, cap: int | None = None, margin: float = 0.0
) -> SearchResult:
    """Gallop from ``start`` until a batch that fits and one that does not (or ``cap``)
    bracket the answer, then bisect; see the module doc. Raises :class:`NoBatchFits` when
    batch 1 does not fit."""
    if start < 1 or (cap is not None and cap < 1):
        raise ValueError(f"start={start} and cap={cap} must be >= 1")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin} must be in [0, 1)")
    limit = cap if cap is not None else 2**31  # a batch that always fits still ends
    results: dict[int, bool] = {}
    order: list[tuple[int, bool]] = []

    def tried(batch: int) -> bool:
        if batch not in results:
            try:
                ok = bool(fits(batch))
            except torch.OutOfMemoryError:
                ok = False
            results[batch] = ok
            order.append((batch, ok))
        return results[batch]

    lo, hi = 0, None  # lo fitted (0: none yet), hi did not (None: none yet)
    batch, step = min(start, limit), 1
    if tried(batch):
        lo = batch
        while lo < limit and hi is None:
            b = min(limit, lo + step)
            lo, hi = (b, hi) if tried(b) else (lo, b)
            step *= 2
    else:
        hi = batch
        while lo == 0 and hi > 1:
            b = max(1, hi - step)
            lo, hi = (b, hi) if tried(b) else (lo, b)
            step *= 2
    if hi is not None:
        while hi - lo > 1 and lo > 0:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tried(mid) else (lo, mid)
    if lo == 0:
        raise NoBatchFits(order)
    chosen = lo if hi is None else max(1, math.floor(lo * (1.0 - margin) + 1e-9))
    return SearchResult(chosen, lo, hi, cap, margin, order)


def _estimated(peak_at: Callable[[int], int], limit: int) -> tuple[Callable[[int], bool], dict[int, int]]:
    """``fits(batch)``: whether the estimated peak at ``batch`` is within ``limit``, each batch
    estimated once; and the peaks estimated so far, by batch."""
    peaks: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_at(b)
        return peaks[b] <= limit

    return fits, peaks


def _line(fits: Callable[[int], bool], peaks: dict[int, int], limit: int, cap: int) -> int:
    """Where the line through the peaks at batches 1 and 2 meets ``limit``; 0 when 1 does not fit."""
    if not fits(1):
        return 0
    if cap == 1:
        return 1
    fits(2)
    slope = max(1, peaks[2] - peaks[1])
    return max(1, min(cap, 1 + (limit - peaks[1]) // slope))


def largest_batch(peak_at: Callable[[int], int], limit: int, *, cap: int = 4096) -> tuple[int, int]:
    """The largest batch up to ``cap`` whose estimated peak ``peak_at(batch)`` is within
    ``limit``: :func:`search` from the line's guess, on estimates alone. Returns (batch,
    estimates made); batch 0 when not even 1 fits."""
    fits, peaks = _estimated(peak_at, limit)
    guess = _line(fits, peaks, limit, cap)
    if guess == 0:
        return 0, len(peaks)
    return search(fits, start=guess, cap=cap).max_fit, len(peaks)


def line_start(cfg: TrainConfig, vocab_size: int, limit: int, cap: int) -> tuple[int | None, str]:
    """Where ``dataloader.batch_size=auto`` starts its search: the batch where the line
    through the estimates at batches 1 and 2 meets ``limit``, or None, with why, when the
    estimate cannot be made. Real trials verify it, so no more estimates are made to bracket it."""
    fits, peaks = _estimated(lambda b: estimate(cfg, vocab_size, batch_size=b, top=0).peak_bytes, limit)
    try:
        batch = _line(fits, peaks, limit, cap)
    except EstimateError as err:
        return None, str(err)
    return (batch or None), f"the line through {len(peaks)} estimates"


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def resolve_auto_batch(
    dl: DataLoaderConfig, device: torch.device, plan: Plan, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, train_sequences: int, example: tuple[torch.Tensor, torch.Tensor],
    step_of: StepOf, start: Callable[[int, int], tuple[int | None, str]] | None = None,
) -> dict[str, Any]:
    """Find the batch for ``dataloader.batch_size=auto``; return what was chosen and how, for
    summary.json (``batch_size`` is the choice). The run then starts as if it had been given.
    ``step_of``: the trainer's step, which each trial takes; ``start(limit_bytes, cap)``: the
    batch the memory estimate fits (:func:`estimated_start`), where the search begins."""
    budget_mib = dl.memory_budget_mib
    if device.type != "cuda" and budget_mib is None:
        import psutil

        avail = psutil.virtual_memory().available / MIB
        raise ConfigError(
            f"dataloader.batch_size=auto on the {device.type} needs dataloader.memory_budget_mib: the CPU has no "
            f"out-of-memory error to recover from; set e.g. dataloader.memory_budget_mib={int(avail // 2)} "
            f"(half of the {avail:,.0f} MiB available now)"
        )
    cap, cap_source = train_sequences, f"the {train_sequences} training sequences"
    if dl.max_batch_size is not None and dl.max_batch_size < cap:
        cap, cap_source = int(dl.max_batch_size), "dataloader.max_batch_size"
    budget = None if budget_mib is None else int(budget_mib * MIB)
    trial = StepTrial(plan, optimizer, device, example, budget, step_of)
    limit = budget if budget is not None else torch.cuda.get_device_properties(device).total_memory
    estimated, how = start(limit, cap) if start is not None else (None, "no estimate")  # where the search starts
    rng, schedule, loss_scale = _rng_state(device), scheduler.state_dict(), plan.state_dict()
    t0 = time.perf_counter()
    try:
        with compilation.eager():  # each trial's batch would compile anew (scope=blocks compiles in place)
            trial.prime()
            result = search(trial, start=estimated or 1, cap=cap, margin=float(dl.batch_margin))
    except NoBatchFits:
        where = f"the budget of {budget_mib:,.0f} MiB" if budget_mib is not None else f"{device}'s memory"
        raise ConfigError(
            f"dataloader.batch_size=auto: not even a batch of 1 fits in {where} (one step peaked at "
            f"{trial.peak_mib.get(1, float('nan')):,.0f} MiB); raise dataloader.memory_budget_mib, or save memory "
            "with checkpointing=full, precision=bf16, a smaller data.seq_len or model"
        ) from None
    finally:
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)
        scheduler.load_state_dict(schedule)
        plan.load_state_dict(loss_scale)
        _set_rng_state(device, rng)
        release(device)
    seconds = time.perf_counter() - t0
    stopped_by = "memory" if result.first_fail is not None else cap_source
    method = (
        "torch.cuda.max_memory_allocated of one training step, OOM caught" if device.type == "cuda"
        else "live tensor bytes of one training step (TorchDispatchMode storage accounting)"
    )
    notes: dict[str, Any] = {
        "requested": "auto",
        **{k: v for k, v in asdict(result).items() if k != "trials"},
        "stopped_by": stopped_by,
        "budget_mib": budget_mib,
        "method": method,
        "trials": [[b, ok, trial.peak_mib.get(b)] for b, ok in result.trials],
        "search_s": round(seconds, 3),
        "estimate": {"largest_batch": estimated, "how": how, "measured": False,
                     "off_pct": 100 * (estimated / result.max_fit - 1) if estimated else None},
    }
    fail = f", first failing {result.first_fail}" if result.first_fail is not None else ""
    log.info(
        f"batch_size=auto: chose {result.batch_size} (largest fitting {result.max_fit}{fail}, "
        f"stopped by {stopped_by}, margin {result.margin:.0%}) after {len(result.trials)} trials in {seconds:.1f} s; "
        f"memory: {method}"
    )
    if estimated:
        log.info(f"batch_size=auto: the estimate said {estimated} fits ({how}); the search found {result.max_fit} "
                 f"({notes['estimate']['off_pct']:+.0f} %)")
    return notes
