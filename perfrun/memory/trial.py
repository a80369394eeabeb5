"""One training step at a given batch, measured: the trial of ``dataloader.batch_size=auto``.

**Trial** (:class:`StepTrial`). One step of the trainer's own :class:`~perfrun.loop.step.TrainStep`
at that batch, with the real model, knobs and optimizer: forward under the knobs' contexts
(autocast, SDPA backend), the plan's backward (fp16's scaled loss), the plan's optimizer step
(unscaling, clipping) and the schedule, on copies of one training item. It leaves the run
exactly as it found it: the step is taken at lr 0, so parameters do not move; the caller
(:func:`perfrun.memory.batch_size.resolve_auto_batch`) clears the optimizer state after the
search and restores the schedule, the loss scale and the RNG states. Trials take one
micro-batch (a micro-batch is what must fit), call the plain model (with activation
checkpointing, which patches the model in place; blocks that ``compile_options.scope=blocks``
compiled in place run eagerly here) and run no step hooks: compiling once per trial size would
cost far more than the search, and the compiled step is not expected to need more memory than
the eager one.

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
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # no public module has it
from torch.utils._pytree import tree_leaves  # no public module has it

from perfrun.knobs import Plan

MIB = 2**20


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


class OneStep(Protocol):
    """The trainer's own step (:class:`perfrun.loop.step.TrainStep`): the loop hands it in, so
    that a trial measures exactly what a training step does without this package importing the loop."""

    params: list[torch.Tensor]

    def __call__(self, step: int) -> object: ...


#: builds the trainer's step over a plan and the trial's batches
StepOf = Callable[[Plan, ItemBatches], OneStep]


class StepTrial:
    """``trial(batch) -> bool``: does one training step at ``batch`` fit? See the module doc."""

    def __init__(self, plan: Plan, optimizer: torch.optim.Optimizer, device: torch.device,
                 example: tuple[torch.Tensor, torch.Tensor], budget_bytes: int | None, step_of: StepOf) -> None:
        self.model, self.optimizer, self.device, self.budget = plan.raw_model, optimizer, device, budget_bytes
        self.peak_mib: dict[int, float] = {}
        self.batches = ItemBatches(device, example)
        # the trainer's step over one micro-batch of the plain model, without the step hooks
        one_micro_batch = replace(plan, model=plan.raw_model, micro_steps=1, step_hooks=[], step_start_hooks=[])
        self.step = step_of(one_micro_batch, self.batches)
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
