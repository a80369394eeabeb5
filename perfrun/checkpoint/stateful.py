"""What the checkpointer saves: any object with ``state_dict()`` and ``load_state_dict()``.

The protocol of torch's distributed checkpoint (``torch.distributed.checkpoint.stateful.Stateful``),
which modules, optimizers and schedules already follow; a part's state is whatever its entry in the
file holds (a dict for most, a count for the tokens seen, None for a loss scale fp16 does not use).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """A part of the run whose state a checkpoint keeps, under the part's name."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...
