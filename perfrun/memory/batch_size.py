"""``dataloader.batch_size=auto``: the largest micro-batch that fits, found by trials.

**Search** (:func:`search`). Grow by doubling from ``start`` until a trial fails or the cap
is reached, then binary-search between the last batch that fitted and the first that did
not. A trial is any ``trial(batch) -> bool``; raising ``torch.OutOfMemoryError`` counts as
"does not fit", so tests can plant a limit and the real trial can let CUDA raise. The
chosen batch is the largest that fitted shrunk by the safety margin,
``floor(max_fit * (1 - margin))``, because the real run is not the trial: the allocator
fragments, and evaluation and data workers take memory of their own. A search stopped by
the cap (``dataloader.max_batch_size``, or the number of training sequences) is not
shrunk: nothing showed that batch to be near the limit.

**Trial** (:class:`StepTrial`). One step of the trainer's own :class:`~perfrun.loop.step.TrainStep`
at that batch, with the real model, knobs and optimizer: forward under the knobs' contexts
(autocast, SDPA backend), the plan's backward (fp16's scaled loss), the plan's optimizer step
(unscaling, clipping) and the schedule, on random tokens of the run's sequence length. It leaves
the run exactly as it found it: the step is taken at lr 0, so parameters do not move; the
optimizer state is cleared after the search, the schedule and the loss scale are restored from
their state dicts, and so are the RNG states; random tokens come from a private generator.
Trials take one micro-batch (a micro-batch is what must fit), call the plain model (with
activation checkpointing, which patches the model in place; blocks that
``compile_options.scope=blocks`` compiled in place run eagerly here) and run no step hooks:
compiling once per trial size would cost minutes, and the compiled step is not expected to need
more memory than the eager one.

**Memory**, by device:

* CUDA: the real limit. An allocation that does not fit raises ``torch.OutOfMemoryError``;
  the trial catches it, drops its tensors, empties the cache and resets the peak
  statistics before the next trial. With ``dataloader.memory_budget_mib`` set, a trial
  whose ``torch.cuda.max_memory_allocated`` exceeds the budget fails too (to leave room
  for something else, or to emulate a smaller GPU).
* CPU: there is no out-of-memory error to recover from (the system kills the process), so
  a budget is required. The trial measures live tensor memory with
  :class:`LiveTensorMemory`, a ``TorchDispatchMode``: every storage an operator creates
  is counted when it first appears and released by a weakref finalizer when it is freed;
  tensors that exist before the trial (parameters, buffers, optimizer state) are the
  base. An allocation that takes base + live past the budget aborts the trial there, as
  an OOM would. This counts tensor memory only: Python objects, libraries and data-loader
  workers are outside the budget, and so is scratch a kernel never exposes as a tensor.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from perfrun.config import ConfigError, DataLoaderConfig
from perfrun.knobs import Plan, compilation
from perfrun.loop.step import TrainStep, Untimed

log = logging.getLogger("perfrun")

MIB = 2**20


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
    trial: Callable[[int], bool], *, start: int = 1, cap: int | None = None, margin: float = 0.0
) -> SearchResult:
    """Doubling from ``start`` until a failure or ``cap``, then binary search; see the module doc.

    Each batch is tried at most once. Raises :class:`NoBatchFits` when batch 1 fails.
    """
    if start < 1 or (cap is not None and cap < 1):
        raise ValueError(f"start={start} and cap={cap} must be >= 1")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin} must be in [0, 1)")
    limit = cap if cap is not None else 2**31  # a trial that always fits still ends
    results: dict[int, bool] = {}
    order: list[tuple[int, bool]] = []

    def fits(batch: int) -> bool:
        if batch not in results:
            try:
                ok = bool(trial(batch))
            except torch.OutOfMemoryError:
                ok = False
            results[batch] = ok
            order.append((batch, ok))
        return results[batch]

    lo, hi = 0, None  # lo fitted (0: none yet), hi failed
    batch = min(start, limit)
    while True:
        if not fits(batch):
            hi = batch
            break
        lo = batch
        if batch >= limit:
            break
        batch = min(2 * batch, limit)
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    if lo == 0:
        raise NoBatchFits(order)
    chosen = lo if hi is None else max(1, math.floor(lo * (1.0 - margin) + 1e-9))
    return SearchResult(chosen, lo, hi, cap, margin, order)


class LiveTensorMemory(TorchDispatchMode):
    """Live bytes of the tensors created under this mode, and their peak (CPU trials).

    ``base_bytes`` is what already existed; with ``limit_bytes``, the operator whose output
    takes base + live past it raises ``torch.OutOfMemoryError`` (and sets ``exceeded``).
    """

    def __init__(self, base_bytes: int = 0, limit_bytes: int | None = None) -> None:
        super().__init__()
        self.base = base_bytes
        self.limit = limit_bytes
        self.live = 0
        self.peak = 0
        self.exceeded = False
        self._sizes: dict[int, int] = {}

    @property
    def peak_bytes(self) -> int:
        return self.base + self.peak

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors
            return
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.live += size
        weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        if self.limit is not None and self.base + self.live > self.limit:
            self.exceeded = True
            raise torch.OutOfMemoryError(
                f"tensor memory {(self.base + self.live) / MIB:,.1f} MiB exceeds the budget {self.limit / MIB:,.1f} MiB"
            )
        return out


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    storages: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[id(storage)] = storage  # held, so an id cannot be reused while summing
    return sum(s.nbytes() for s in storages.values())


@contextmanager
def _zero_lr(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Every param group at lr 0 for a step that must not move the parameters."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr


def release(device: torch.device) -> None:
    """Give memory back between trials (and reset CUDA's peak so each trial measures its own).

    Only CUDA needs the garbage collector (an OOM's traceback can hold tensors in cycles);
    a CPU trial measures what it allocates itself, and a full collection can take a good
    part of a second once torch's compiler modules are loaded.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class ItemBatches:
    """A trial's batches: ``size`` copies of one training item (input, target), so that any
    model gets its own shapes and dtypes; the run's random streams are not drawn from."""

    def __init__(self, device: torch.device, example: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.example = tuple(t.to(device) for t in example)
        self.size = 1

    def start(self) -> None:
        """Nothing to start: every batch is made when it is taken."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (t.unsqueeze(0).expand(self.size, *t.shape).contiguous() for t in self.example)
        return x, y


class StepTrial:
    """``trial(batch) -> bool``: does one training step at ``batch`` fit? See the module doc."""

    def __init__(self, plan: Plan, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 device: torch.device, example: tuple[torch.Tensor, torch.Tensor], budget_bytes: int | None, *,
                 clip: float) -> None:
        self.model, self.optimizer, self.device, self.budget = plan.raw_model, optimizer, device, budget_bytes
        self.peak_mib: dict[int, float] = {}
        self.batches = ItemBatches(device, example)
        # the trainer's step over one micro-batch of the plain model, without the step hooks
        one_micro_batch = replace(plan, model=plan.raw_model, micro_steps=1, step_hooks=[], step_start_hooks=[])
        self.step = TrainStep(one_micro_batch, optimizer, scheduler, self.batches, Untimed(), clip=clip, device=device)
        self._params = self.step.params

    def _resident(self) -> Iterator[torch.Tensor]:
        """Tensors alive before a trial: parameters, buffers, gradients, optimizer state."""
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from (p.grad for p in self._params if p.grad is not None)
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _step(self, batch: int) -> None:
        self.batches.size = batch
        with _zero_lr(self.optimizer):
            self.step(0)

    def prime(self) -> None:
        """Create the optimizer state first, so every trial counts it (as every real step does)."""
        for p in self._params:
            p.grad = torch.zeros_like(p)
        with _zero_lr(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, batch: int) -> bool:
        release(self.device)
        cuda = self.device.type == "cuda"
        track = None if cuda else LiveTensorMemory(tensor_bytes(self._resident()), self.budget)
        ok = True
        try:
            with track if track is not None else nullcontext():
                self._step(batch)
        except torch.OutOfMemoryError:
            ok = False
        except Exception:
            if track is None or not track.exceeded:  # a real error, not the budget
                raise
            ok = False  # the autograd engine may re-raise our OOM as a RuntimeError
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else track.peak_bytes  # type: ignore[union-attr]
        if self.budget is not None and peak > self.budget:
            ok = False
        self.peak_mib[batch] = peak / MIB  # unrounded: a trial just over the budget must read as over it
        release(self.device)
        return ok


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def resolve_auto_batch(
    dl: DataLoaderConfig, device: torch.device, plan: Plan, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, train_sequences: int, example: tuple[torch.Tensor, torch.Tensor],
    clip: float, start: Callable[[int, int], tuple[int | None, str]] | None = None,
) -> dict[str, Any]:
    """Find the batch for ``dataloader.batch_size=auto``; return what was chosen and how, for
    summary.json (``batch_size`` is the choice). The run then starts as if it had been given.
    ``start(limit_bytes, cap)``: the batch the memory estimate fits, where the search begins."""
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
    trial = StepTrial(plan, optimizer, scheduler, device, example, budget, clip=clip)
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
