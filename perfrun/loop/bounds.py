"""Values the schema's types accept but no run means: refused in one line before any work
(the single run's preflight) and again where each job builds its loop (sweep jobs, tune,
the Python API)."""

from __future__ import annotations

import math
from typing import Any

from perfrun.config import ConfigError

#: The most micro-batches per optimizer step: GPT-2's 0.5M-token batch at batch_size=1 and
#: 1024 positions is 480 of them; more than this is a typo, not a recipe.
MAX_ACCUMULATION_STEPS = 1024


def check_bounds(cfg: Any) -> None:
    """accumulation.steps within :data:`MAX_ACCUMULATION_STEPS`; the ladder's time budgets positive."""
    steps = cfg.accumulation.steps
    if steps > MAX_ACCUMULATION_STEPS:
        raise ConfigError(
            f"accumulation.steps={steps} is more than {MAX_ACCUMULATION_STEPS} micro-batches per optimizer step "
            f"(GPT-2's 0.5M-token batch at batch_size=1 is 480); set accumulation.steps to {MAX_ACCUMULATION_STEPS} "
            "or less, or raise dataloader.batch_size instead")
    for key in ("budget_s", "target_s"):
        value = getattr(cfg.ablation, key, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"ablation.{key}={value} must be a positive number of seconds, or null for no bound")
