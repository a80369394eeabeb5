"""``loss=standard|chunked``: the function the model's forward computes its loss with.

The function replaces the plain model's ``loss_fn`` before any wrapper sees the model, so
DDP, FSDP2 and ``torch.compile`` all run it inside forward; the job's end puts the
previous function back.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from perfrun.config import TrainConfig
from perfrun.models import losses


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    model = plan.raw_model
    stack.callback(setattr, model, "loss_fn", model.loss_fn)
    model.loss_fn = losses.build(cfg.loss)
    plan.notes["loss"] = {"name": cfg.loss.name, **({"chunk_size": int(cfg.loss.chunk_size)}
                                                    if cfg.loss.name == "chunked" else {})}
