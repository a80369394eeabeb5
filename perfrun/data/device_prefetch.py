"""Host batches copied to the GPU one step ahead, on a side stream, in their exact order.

The loop's plain ``x.to(device, non_blocking=True)`` queues the copy on the compute
stream, so every step's kernels wait behind its own input's copy. :class:`DevicePrefetcher`
instead copies batch k+1 on a side CUDA stream while step k runs:

* the host tensors are in pinned memory (the DataLoader's ``pin_memory``, or pinned here),
  so the copy is asynchronous; torch's pinned-memory allocator keeps a pinned block until
  the copy that reads it has finished;
* the consumer (the stream current at hand-off) waits on the copy's event before it may
  use the batch: a wait queued on the device, never on the host, so no step syncs;
* the device tensors were allocated on the side stream; ``record_stream`` tells the
  caching allocator that the consumer uses them, so their memory is not handed to a later
  copy while the consumer's queued work may still read it.

The order of batches is the source's (nothing is dropped, reordered or repeated), and
:meth:`DevicePrefetcher.position` gives the source's position as it was when the batch
last handed over was read (not the batch already read ahead), so a checkpoint resumes on
exactly the next batch.

How long the GPU waited for each batch (the copy's landing and the host's reading of the
next batch alike) is timed by the caller around each hand-off (perfrun/data/handoff_timer.py).
On the CPU (or with ``ahead=False``) it is a pass-through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

Batch = tuple[torch.Tensor, ...]


@dataclass
class _Staged:
    """A batch read from the source (its copy maybe still under way) and where the source was then."""

    batch: Batch
    position: Any
    ready: torch.cuda.Event | None  # recorded on the side stream after the copy


class DevicePrefetcher:
    """Iterate over ``batches`` (tuples of host tensors) as tuples of tensors on ``device``.

    ``position``: a callable that returns the source's resumable position (read after each
    batch is taken from the source). ``ahead``: read and copy one batch ahead; by default
    on CUDA only (on the CPU there is no copy to hide).
    """

    def __init__(
        self, batches: Iterable[Batch], device: torch.device, *,
        position: Callable[[], Any] | None = None, ahead: bool | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.ahead = self.cuda if ahead is None else bool(ahead)
        self.handed = 0  # batches handed to the consumer
        self._batches: Iterator[Batch] = iter(batches)
        self._read_position = position if position is not None else lambda: None
        self._position = self._read_position()
        self._stream = torch.cuda.Stream(device) if self.cuda and self.ahead else None
        self._next: _Staged | None = None  # the batch read ahead; None once the source is exhausted
        self._started = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        if not self.ahead:
            batch = tuple(t.to(self.device, non_blocking=True) for t in next(self._batches))
            self._position = self._read_position()
            self.handed += 1
            return batch
        if not self._started:
            self._next, self._started = self._stage(), True
        staged = self._next
        if staged is None:
            raise StopIteration
        batch = self._hand_over(staged)
        self._next = self._stage()  # batch k+1's copy starts before step k is queued
        self._position = staged.position
        self.handed += 1
        return batch

    def position(self) -> Any:
        """The source's position after the last batch handed over (what a checkpoint saves)."""
        return self._position

    def _stage(self) -> _Staged | None:
        """Read the next host batch and, on CUDA, start its copy on the side stream."""
        try:
            host = next(self._batches)
        except StopIteration:
            return None
        position = self._read_position()
        if self._stream is None:
            return _Staged(tuple(t.to(self.device) for t in host), position, None)
        host = tuple(t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t for t in host)
        with torch.cuda.stream(self._stream):
            batch = tuple(t.to(self.device, non_blocking=True) for t in host)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return _Staged(batch, position, ready)

    def _hand_over(self, staged: _Staged) -> Batch:
        """Make the consumer's stream wait for the copy (on the device, not the host)."""
        if staged.ready is None:
            return staged.batch
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(staged.ready)
        for t in staged.batch:
            t.record_stream(consumer)
        return staged.batch
