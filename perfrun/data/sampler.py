"""The training order: a seeded shuffle that can start anywhere and shards by rank."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

CHUNK = 1 << 14  # indices turned into Python ints at a time


class ResumableSampler(Sampler[int]):
    """A seeded shuffle that can start anywhere: epoch ``e`` is the permutation drawn from
    ``seed + e`` alone, and iteration starts at ``start`` within it.

    This is what makes resume exact: the trainer records (epoch, samples consumed) and a
    resumed run rebuilds the same order from there, without replaying earlier epochs.

    Under DDP each of ``world`` ranks takes every ``world``-th index from ``start`` on
    (``start`` counts samples of all ranks), so batch k of the ranks together is batch k of
    one process with a batch ``world`` times as large: the global order does not depend on
    the number of ranks. The tail is cut to a multiple of ``world`` so that every rank has
    as many batches as the others (a rank that ran out first would wait forever).
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.rank, self.world = rank, world
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.n, self.seed + self.epoch)[self.start:]
        order = order[: len(order) - len(order) % self.world][self.rank::self.world]
        # handed out a chunk at a time: the whole epoch as a list of Python ints costs some 40
        # bytes an index, made before a short job's first batch could start
        for chunk in order.split(CHUNK):
            yield from chunk.tolist()

    def __len__(self) -> int:
        return (self.n - self.start) // self.world


@functools.lru_cache(maxsize=1)
def epoch_order(n: int, seed: int) -> torch.Tensor:
    """The permutation of ``n`` drawn from ``seed`` (read only: every use takes views). The
    last one drawn is kept: the jobs of a sweep run in one process and draw the same epoch
    of the same data (8 bytes an index; a draw grows with the number of windows, and a
    sweep would repeat it in every job)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
