"""The DataLoader that feeds the trainer: its order depends on the seed alone."""

from __future__ import annotations

import signal
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from perfrun.config import ConfigError, DataLoaderConfig
from perfrun.data.sampler import ResumableSampler


def ignore_sigint(worker_id: int) -> None:
    """Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the trainer (not
    its workers) decides how to stop; a worker killed by it would break the last step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_loader(
    dataset: Dataset, dl_cfg: DataLoaderConfig, *, device_type: str, shuffle: bool, seed: int, rank: int = 0, world: int = 1
) -> DataLoader:
    """A DataLoader whose order depends on ``seed`` only (not on batch size or workers).

    ``shuffle=True`` draws one seeded permutation per epoch (:class:`ResumableSampler`) and ``drop_last`` cuts it into
    batches, so batch 8 is exactly four consecutive batches of 2. The loader also gets its
    own generator for the workers' base seed, so creating an iterator (e.g. for each eval)
    never draws from torch's global RNG and cannot perturb training randomness.

    ``rank``/``world`` shard the order (see :class:`ResumableSampler`), the validation
    order too, so that the ranks' mean val loss is the one-process figure.

    A training loader (``shuffle=True``) with fewer sequences than one batch is a
    ConfigError: it would yield nothing, forever. A validation loader is allowed to be
    empty; the trainer warns that there is no val loss and trains on.
    """
    batch_size = int(dl_cfg.batch_size)
    n = len(dataset)  # type: ignore[arg-type]
    if shuffle and n < batch_size * world:
        raise ConfigError(
            f"dataloader.batch_size={batch_size}" + (f" x {world} ranks" if world > 1 else "")
            + f" is larger than the {n} training sequences, "
            f"so the loader would yield no batch; set dataloader.batch_size<={max(n // world, 1)}, "
            "use more data or a smaller data.seq_len"
        )
    workers = int(dl_cfg.num_workers)
    sampler: Any = (
        ResumableSampler(n, int(seed), rank, world) if shuffle else SequentialSampler(dataset)
    )
    if not shuffle and world > 1:  # batch k of all ranks = batch k of one process, as for training
        sampler = list(range(n - n % world))[rank::world]
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs["persistent_workers"] = bool(dl_cfg.persistent_workers)
        if getattr(dl_cfg, "prefetch_factor", None) is not None:
            kwargs["prefetch_factor"] = int(dl_cfg.prefetch_factor)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=bool(dl_cfg.pin_memory) and device_type == "cuda",
        drop_last=True,
        generator=torch.Generator().manual_seed(int(seed) + 1),
        worker_init_fn=ignore_sigint if workers > 0 else None,
        **kwargs,
    )
