"""``loss=standard|chunked``: the function the model's forward computes its loss with.

The function replaces the plain model's ``loss_fn`` before any wrapper sees the model, so
DDP, FSDP2 and ``torch.compile`` all run it inside forward; the job's end puts the
previous function back. A model without an output head (perfrun.models.contract.OutputHead)
keeps its own loss under ``loss=standard`` and refuses ``loss=chunked``.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from perfrun.config import TrainConfig
from perfrun.knobs.refusal import need
from perfrun.models import contract, losses


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    model = plan.raw_model
    if cfg.loss.name == "standard" and not contract.has(model, "head"):
        plan.notes["loss"] = {"name": "the model's own"}  # nothing to swap: its forward computes its loss
        return
    need(model, "head", f"loss={cfg.loss.name}")
    stack.callback(setattr, model, "loss_fn", model.loss_fn)
    model.loss_fn = losses.build(cfg.loss)
    plan.notes["loss"] = {"name": cfg.loss.name, **({"chunk_size": int(cfg.loss.chunk_size)}
                                                    if cfg.loss.name == "chunked" else {})}
