"""How long the GPU waited for each batch, timed on the device without a sync.

A pair of CUDA events goes on the compute stream around each batch's hand-off: the first
is recorded before the host asks for the batch, the second once the batch is usable on
that stream (its copy waited for, or its tokens drawn on the device). Nothing else is
queued between them, so the GPU passes the first when the previous step's work is done
and the second when the host has the batch queued: the time between is the time the GPU
had nothing to do but wait for its input. The host being late to read a batch counts (the
GPU ran dry while it read), and so does a copy that had not landed; a host that read the
batch while the GPU was still busy with the step before costs nothing. The pairs are read
later with ``query()``, which never blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class HandOffTimer:
    """Device-timed waits of the compute stream for its batches (CUDA only; a no-op elsewhere).

    ``new_event`` and ``stream`` default to timing CUDA events and the device's current
    stream; a simulated device timeline can stand in for both (the CPU tests do).
    """

    def __init__(self, device: torch.device, *, new_event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda" or new_event is not None
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: torch.cuda.current_stream(self.device))
        self._pending: deque[tuple[Any, Any]] = deque()
        self._done_ms: list[float] = []

    @contextmanager
    def hand_off(self) -> Iterator[None]:
        """Time what runs inside (taking a batch and putting it on the device)."""
        if not self.cuda:
            yield
            return
        start, end = self._new_event(), self._new_event()
        start.record(self._stream())
        yield
        end.record(self._stream())
        self._pending.append((start, end))
        self._harvest()

    def pop_ms(self) -> list[float] | None:
        """Milliseconds of each hand-off the GPU has passed since the last call (later ones
        are read next time); None off CUDA, where no device timeline exists."""
        if not self.cuda:
            return None
        self._harvest()
        done, self._done_ms = self._done_ms, []
        return done

    def _harvest(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._done_ms.append(start.elapsed_time(end))
