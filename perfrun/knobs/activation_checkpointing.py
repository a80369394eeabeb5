"""Activation checkpointing with ``torch.utils.checkpoint`` (use_reentrant=False), on the
model's repeated ``blocks`` (perfrun.models.contract.RepeatedBlocks).

Each chosen block's ``forward`` is replaced on the instance, so parameter names and the
state dict stay those of the plain model; undoing removes the instance attribute.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from perfrun.config import TrainConfig
from perfrun.knobs.refusal import need


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    every_k = 0 if cfg.checkpointing.name == "none" else int(cfg.checkpointing.every_k)
    plan.notes["checkpointing"] = cfg.checkpointing.name
    if every_k < 1:
        plan.notes["checkpointed_blocks"] = 0
        return
    need(plan.raw_model, "blocks", f"checkpointing={cfg.checkpointing.name}")
    chosen = [b for i, b in enumerate(plan.raw_model.blocks) if (i + 1) % every_k == 0]
    for block in chosen:
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        stack.callback(block.__dict__.pop, "forward", None)
    plan.notes["checkpointed_blocks"] = len(chosen)
