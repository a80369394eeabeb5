"""One optimizer step, and the endless stream of batches it draws from.

The step knows no knob: it enters the plan's contexts around each micro-step and leaves
backward, unscaling, clipping and the optimizer step to the plan (fp16's loss scaling,
FSDP's sharded gradient norm and DDP's skipped all-reduce live there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from perfrun.config import ConfigError
from perfrun.data.device_prefetch import DevicePrefetcher
from perfrun.data.device_synthetic import DeviceSyntheticStream
from perfrun.data.handoff_timer import HandOffTimer
from perfrun.data.synthetic import SyntheticTokens
from perfrun.knobs import Plan
from perfrun.telemetry.step_metrics import StepMetrics


class BatchStream:
    """Endless batches from a resumable position: (epoch, samples consumed in it).

    The position counts what the loop took, not what workers prefetched, so a checkpoint
    taken between steps resumes on exactly the next batch. Under DDP it counts the samples
    of all ranks (each takes one batch per call), the unit the sharded sampler starts from.

    On CUDA the batches reach the loop on the device already: ``data=synthetic`` draws them
    there (:class:`DeviceSyntheticStream`), any other source is copied one batch ahead on a
    side stream (:class:`DevicePrefetcher`), in the same order and with the position of the
    batch handed over. On the CPU the loader's batches are handed over as they come
    (``ahead=True`` takes the CUDA path there too: what tests of its order can run).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device | None = None, *,
                 ahead: bool | None = None) -> None:
        self.loader = loader
        self.device = device if device is not None else torch.device("cpu")
        self.ahead = self.device.type == "cuda" if ahead is None else ahead
        self.batch_size = int(loader.batch_size) * getattr(loader.sampler, "world", 1)
        self.epoch = self.consumed = 0  # the host source's position (on CUDA: one batch ahead of the loop)
        self._it: Any = None  # made by start(): the loader's workers start there
        self._ahead: DevicePrefetcher | DeviceSyntheticStream | None = None  # CUDA only
        self.timer = HandOffTimer(self.device)  # the GPU's waits for its batches (CUDA)

    @property
    def input_path(self) -> str:
        """How batches reach the step, for summary.json's knobs."""
        if not self.ahead:
            return "loader" if self.device.type == "cpu" else "loader, copied when taken"
        return "drawn on the device" if isinstance(self.loader.dataset, SyntheticTokens) else "copied ahead on a side stream"

    def start(self, epoch: int | None = None, consumed: int | None = None) -> None:
        """Batches from (epoch, consumed); by default from the position a checkpoint gave
        (:meth:`load_state_dict`), else from the beginning."""
        self.epoch = self.epoch if epoch is None else epoch
        self.consumed = self.consumed if consumed is None else consumed
        epoch, consumed = self.epoch, self.consumed
        self._ahead = None
        if self.ahead and isinstance(self.loader.dataset, SyntheticTokens):
            self._ahead = self._device_synthetic(epoch, consumed)
            return
        self.loader.sampler.set_position(epoch, consumed)
        self._it = iter(self.loader)
        if self.ahead:
            self._ahead = DevicePrefetcher(self._host_batches(), self.device, position=self._host_position,
                                           ahead=True)

    def next(self) -> Any:
        return self._read_host() if self._ahead is None else next(self._ahead)

    def take(self) -> tuple[torch.Tensor, ...]:
        """The next batch, on the device, its hand-off timed on the device (CUDA)."""
        with self.timer.hand_off():
            return tuple(t.to(self.device, non_blocking=True) for t in self.next())

    def position(self) -> dict[str, int]:
        return self._host_position() if self._ahead is None else self._ahead.position()

    def state_dict(self) -> dict[str, int]:
        """A checkpoint's data position: the next batch the loop takes."""
        return self.position()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Start (at :meth:`start`) from a checkpoint's position."""
        self.epoch, self.consumed = int(state_dict["epoch"]), int(state_dict["consumed"])

    def pop_gpu_wait_ms(self) -> list[float] | None:
        """How long the GPU waited for each batch since the last call (:class:`HandOffTimer`);
        None off CUDA."""
        return self.timer.pop_ms()

    def _read_host(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.consumed = self.epoch + 1, 0
            self.loader.sampler.set_position(self.epoch, 0)
            self._it = iter(self.loader)
            batch = next(self._it)
        self.consumed += self.batch_size
        return batch

    def _host_batches(self) -> Iterator[Any]:
        while True:
            yield self._read_host()

    def _host_position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def _device_synthetic(self, epoch: int, consumed: int) -> DeviceSyntheticStream:
        """The host synthetic source's parameters, drawn on the device from ``consumed`` on."""
        data, sampler = self.loader.dataset, self.loader.sampler
        if epoch:  # the synthetic split holds over a million windows: no run gets to a second epoch
            raise ConfigError(f"data=synthetic on CUDA resumes within its first epoch, not at epoch {epoch}; "
                              "start the run afresh (resume=null)")
        return DeviceSyntheticStream(
            vocab_size=data.vocab_size, seq_len=data.seq_len, batch_size=int(self.loader.batch_size), seed=data.seed,
            device=self.device, stream=data.stream, rank=getattr(sampler, "rank", 0),
            world=getattr(sampler, "world", 1), consumed=consumed)


class Batches(Protocol):
    """Where a step takes its batches: the run's :class:`BatchStream`, or the random tokens
    of a batch-size trial (:mod:`perfrun.memory.batch_size`)."""

    def start(self) -> None: ...

    def take(self) -> tuple[torch.Tensor, ...]: ...


class _NoMarks:
    @staticmethod
    def mark(phase: str) -> None:
        """A phase of an untimed step ended: nothing to record."""


class Untimed:
    """The step metrics of a step that is no part of the run's figures (a batch-size trial)."""

    phases = _NoMarks()

    def begin_step(self) -> None:
        """Nothing is timed."""

    def end_step(self) -> None:
        """Nothing is timed."""


class TrainStep:
    """``plan.micro_steps`` micro-batches (forward under the plan's contexts, the plan's
    backward), then the plan's optimizer step and the schedule, timed phase by phase.
    The one training step: the run's, and the batch-size search's trials."""

    def __init__(self, plan: Plan, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 stream: Batches, metrics: StepMetrics | Untimed, *, clip: float, device: torch.device) -> None:
        self.plan, self.optimizer, self.scheduler, self.stream = plan, optimizer, scheduler, stream
        self.metrics, self.device = metrics, device
        self.params = [p for p in plan.raw_model.parameters() if p.requires_grad]
        self.clip = clip if clip > 0 else math.inf

    def start(self) -> None:
        """Batches from the stream's position (a resumed run's), the model in training mode."""
        self.stream.start()
        self.plan.model.train()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Run optimizer step ``step``; return its loss and gradient norm (on the device,
        unsynchronised) and the seconds spent waiting for batches."""
        plan, micro, mark = self.plan, self.plan.micro_steps, self.metrics.phases.mark
        for hook in plan.step_start_hooks:
            hook(step)
        self.metrics.begin_step()
        wait = 0.0
        step_loss: torch.Tensor | None = None  # one micro-step: its loss itself, no zeros + add on the device
        for i in range(micro):
            t = time.perf_counter()
            x, y = self.stream.take()
            wait += time.perf_counter() - t
            mark("data")
            with plan.micro_step_context(i, micro):  # DDP, FSDP: gradients synchronised on the last only
                with plan.forward_context():
                    _, loss = plan.model(x, y)
                    loss = loss / micro
                mark("forward")
                plan.backward(loss)
                mark("backward")
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        grad_norm = plan.optimizer_step(self.optimizer, self.params, self.clip)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        mark("optimizer")
        self.metrics.end_step()
        for hook in plan.step_hooks:
            hook(step)
        assert step_loss is not None  # plan.micro_steps >= 1 (config validation)
        return step_loss, grad_norm, wait
