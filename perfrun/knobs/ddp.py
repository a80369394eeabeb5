"""``distributed=ddp``: wrap the model in DistributedDataParallel.

Applied after activation checkpointing (which patches blocks in place) and before
compile, so that compile sees DDP's bucketed all-reduce hooks and can overlap them with
the backward. The loop gets a ``micro_step_context`` that skips the all-reduce on all
but the last micro-batch of an accumulation step.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from perfrun import distributed
from perfrun.config import TrainConfig


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    plan.notes["distributed"] = cfg.distributed
    plan.notes["world_size"] = distributed.world_size()
    if cfg.distributed != "ddp":
        return
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(plan.model, device_ids=ids)
    plan.model = ddp
    plan.micro_step_context = distributed.no_sync_factory(ddp)
    plan.notes["ddp_backend"] = torch.distributed.get_backend()
