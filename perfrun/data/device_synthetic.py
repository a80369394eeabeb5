"""Synthetic token batches generated on the device: no host work, no copy, exact resume.

``data=synthetic`` otherwise builds every window with numpy on the host and copies it to
the GPU. :class:`DeviceSyntheticStream` draws a whole batch with one ``torch.randint`` on
the device, from a ``torch.Generator`` there, seeded by (seed, stream, batch index)
through numpy's ``SeedSequence``: batch k is a pure function of those three numbers, so a
run resumed at batch k sees what an uninterrupted run sees at k, and nothing is drawn
from torch's global random state.

Batch k holds the rows of the global batch (``batch_size`` x ``world``); rank r takes
rows r, r + world, ... so that the ranks together see the batch one process would.
Unlike the host source (one window per index), the tokens depend on the global batch
size, which a resume keeps anyway. The same seed gives other tokens on the CPU than on
CUDA (another generator algorithm), each reproducible on its own.

It has the interface of the trainer's batch stream: ``next()`` and ``position()`` as
``{"epoch": 0, "consumed": samples}``, so checkpoints keep their format.
"""

from __future__ import annotations

import numpy as np
import torch


def batch_seed(seed: int, stream: int, index: int) -> int:
    """A 64-bit generator seed from (seed, stream, index), well mixed by numpy's SeedSequence."""
    state = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, stream, index]).generate_state(1, np.uint64)
    return int(state[0])


class DeviceSyntheticStream:
    """Endless batches of random tokens in [0, vocab_size) made on ``device``, from batch
    ``consumed // (batch_size * world)`` on; ``stream`` separates train (0) from val (1)."""

    def __init__(
        self, *, vocab_size: int, seq_len: int, batch_size: int, seed: int, device: torch.device,
        stream: int = 0, rank: int = 0, world: int = 1, consumed: int = 0,
    ) -> None:
        self.vocab_size, self.seq_len = int(vocab_size), int(seq_len)
        self.seed, self.stream = int(seed), int(stream)
        self.rank, self.world = int(rank), int(world)
        self.device = device
        self.batch_size = int(batch_size) * self.world  # samples per call, all ranks together
        if consumed % self.batch_size:
            raise ValueError(f"consumed={consumed} is not a whole number of global batches of {self.batch_size}")
        self.index = consumed // self.batch_size
        self._generator = torch.Generator(device=device)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of batch ``index``: y is x shifted by one token."""
        self._generator.manual_seed(batch_seed(self.seed, self.stream, index))
        windows = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1),
                                generator=self._generator, device=self.device)
        mine = windows[self.rank::self.world]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch(self.index)
        self.index += 1
        return batch

    def __iter__(self) -> DeviceSyntheticStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def position(self) -> dict[str, int]:
        return {"epoch": 0, "consumed": self.index * self.batch_size}
