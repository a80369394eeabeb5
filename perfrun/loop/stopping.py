"""What stops a run cleanly: a signal (SIGINT, SIGTERM) or a loss that stopped being finite."""

from __future__ import annotations

import logging
import math
import signal
import threading
from types import FrameType
from typing import Any

import torch

from perfrun import distributed

log = logging.getLogger("perfrun")


class Interrupted(Exception):
    """The run stopped on a signal; the exit code is 128 + the signal's number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class Diverged(RuntimeError):
    """Too many consecutive non-finite steps."""


class GracefulStop:
    """First SIGINT or SIGTERM: finish the current step, then stop (the loop asks
    ``requested``). A second SIGINT stops at once (KeyboardInterrupt). Handlers are
    restored on exit, so a sweep's next job, or the caller, gets its own back. The handler
    only records the signal: what it says is logged by the loop's next call, since a handler
    that writes could land inside a write to the same stream (a reentrant-call error)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._said = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Called after every step: True on every rank once one rank got a signal, so that
        all stop at the same step (a host-side flag: no GPU synchronisation)."""
        self._announce()
        return distributed.any_rank(self.requested)

    def stop_signal(self) -> int:
        """The signal that stopped the run; SIGTERM where another rank received it."""
        return self.signum or int(signal.SIGTERM)

    def refuse_during_setup(self) -> None:
        """A signal during setup stops the run there: there is nothing to save yet."""
        self._announce()
        if self.signum is not None:
            raise Interrupted(self.signum, f"stopped by {signal.Signals(self.signum).name} during setup, before step 1")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def _announce(self) -> None:
        if self.signum is None or self._said:
            return
        self._said = True
        log.warning(f"{signal.Signals(self.signum).name} received: stopping after this step and saving a checkpoint"
                    + (" (Ctrl-C again to stop at once)" if self.signum == signal.SIGINT else ""))

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


class NonFiniteGuard:
    """Counts non-finite steps without a synchronisation per step.

    Each step's flags (loss finite? gradient norm finite?) are computed on the device and
    copied, non-blocking, to pinned host memory; a step's flags are read once its event has
    completed (polled without waiting) or at the next log point, so the GPU queue is never
    drained for the check; a divergence is seen at the latest one log interval late. With fp16
    the gradient scaler already skips steps with inf/NaN gradients: those are counted as
    skipped, and only a non-finite loss counts toward stopping. Otherwise any non-finite
    loss or gradient counts, and ``max_bad`` in a row raise :class:`Diverged`.
    """

    def __init__(self, device: torch.device, max_bad: int, scaler_skips: bool) -> None:
        self.device = device
        self.max_bad = max_bad
        self.scaler_skips = scaler_skips
        self.lagged = device.type == "cuda"
        self.nonfinite_steps = 0
        self.skipped_steps = 0
        self.streak = 0
        self.max_streak = 0
        self.first_bad_step: int | None = None
        self._pending: list[tuple[int, torch.Tensor, Any]] = []

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if not self.lagged:  # off CUDA a read costs no sync: two numbers checked, no tensor work
            self._count(step, not math.isfinite(loss.item()), not math.isfinite(grad_norm.item()))
            return
        flags = ~torch.isfinite(torch.stack([loss.detach().float(), grad_norm.detach().float()]))
        host = torch.empty(2, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, host, event))
        # Resolve, oldest first, only what the device has already finished: never wait.
        while self._pending and self._pending[0][2].query():
            self._resolve(self._pending.pop(0))

    def flush(self) -> None:
        """Resolve every pending step now (at log points, before a checkpoint, at the end)."""
        while self._pending:
            self._resolve(self._pending.pop(0))

    def all_finite(self) -> bool:
        """Every rank's last step was finite (before a checkpoint: never save a NaN state)."""
        self.flush()
        return not distributed.any_rank(bool(self.streak))

    def _resolve(self, pending: tuple[int, torch.Tensor, Any]) -> None:
        step, host, event = pending
        event.synchronize()
        self._count(step, bool(host[0]), bool(host[1]))

    def _count(self, step: int, bad_loss: bool, bad_grad: bool) -> None:
        if self.scaler_skips and bad_grad:
            self.skipped_steps += 1
        bad = bad_loss if self.scaler_skips else (bad_loss or bad_grad)
        if not bad:
            self.streak = 0
            return
        self.nonfinite_steps += 1
        if self.streak == 0:
            self.first_bad_step = step
        self.streak += 1
        self.max_streak = max(self.max_streak, self.streak)
        if self.streak >= self.max_bad:
            raise Diverged(
                f"training diverged: the loss{'' if self.scaler_skips else ' or gradient'} was not finite for "
                f"{self.streak} consecutive steps (steps {self.first_bad_step}-{step}); lower optim.lr, "
                "use precision=bf16 (fp16 overflows), or clip gradients with optim.grad_clip=1.0"
            )

    def summary(self) -> dict[str, Any]:
        return {"nonfinite_steps": self.nonfinite_steps, "scaler_skipped_steps": self.skipped_steps,
                "max_nonfinite_streak": self.max_streak, "max_bad_steps": self.max_bad}
