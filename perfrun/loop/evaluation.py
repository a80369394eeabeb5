"""Validation loss on a cadence: every ``eval_every`` steps and at the last step."""

from __future__ import annotations

import logging
import time

import torch

from perfrun import distributed
from perfrun.knobs import Plan, compilation
from perfrun.summary import RunSummary

log = logging.getLogger("perfrun")


class Evaluator:
    """Mean validation loss over the first ``batches`` batches of the (unshuffled) val set.

    Runs the uncompiled model: switching a compiled one to eval mode would recompile it
    (dynamo guards on ``training``), and that time has nothing to do with training speed.
    """

    def __init__(self, plan: Plan, loader: torch.utils.data.DataLoader, device: torch.device, *,
                 every: int, batches: int, max_steps: int) -> None:
        self.plan, self.loader, self.device = plan, loader, device
        self.every, self.batches, self.max_steps = every, batches, max_steps
        self.time_s = 0.0

    def should_run(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self) -> float | None:
        """The val loss averaged over ranks (each saw its shard); None without one batch."""
        t = time.perf_counter()
        loss = self._evaluate()
        self.time_s += time.perf_counter() - t
        return loss

    @torch.no_grad()
    def _evaluate(self) -> float | None:
        model = self.plan.raw_model
        model.eval()
        losses = []
        for i, (x, y) in enumerate(self.loader):
            if i >= self.batches:
                break
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.plan.forward_context(), compilation.eager():  # the plain model, eagerly
                _, loss = model(x, y)
            losses.append(loss.float())
        model.train()
        if not losses:
            log.warning("validation set holds less than one batch: no val loss (lower dataloader.batch_size or raise data.val_fraction)")
            return None
        return distributed.mean_over_ranks(torch.stack(losses).mean()).item()

    def summary(self) -> RunSummary:
        return {"eval_time_s": self.time_s}
