"""A job bounded by time instead of a step count (``ablation.budget_s``): the ladder measures a
rung whose step is far slower than the naive trainer's for as long as it needs for a median,
not for the full step count, and the job says so in its summary."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("perfrun")

# steady steps a budgeted job runs after its warm-up: enough for a median and a spread; fewer
# (but at least MIN_STEADY_STEPS_SLOW) where the steady steps alone have filled the budget
MIN_STEADY_STEPS = 10
MIN_STEADY_STEPS_SLOW = 3
SLOW_STEADY_S = 2.0  # ... and at least this long: steps of 0.7 s or more, whatever the budget


class TimeBudget:
    """Stops the loop once ``budget_s`` seconds of training have passed and the warm-up plus
    :data:`MIN_STEADY_STEPS` steady steps are done, or, for a step so slow that fewer steady
    steps fill the budget (and :data:`SLOW_STEADY_S`) on their own, :data:`MIN_STEADY_STEPS_SLOW`
    of them (a 1.3 s step: 3 steps, not 10, within a 2.8 s budget); never stops it when
    ``budget_s`` is None."""

    def __init__(self, budget_s: float | None, warmup_steps: int, max_steps: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s = budget_s
        self.clock = clock  # seconds, monotonic
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.first_step = 1
        self.stopped_at: int | None = None
        self._t0 = self.clock()
        self._t_steady: float | None = None  # when the warm-up ended

    def start(self, step: int) -> None:
        """The loop starts after ``step`` (0, or the step a resume continues from)."""
        self.first_step = step + 1
        self._t0 = self.clock()
        self._t_steady = self._t0 if self.warmup_steps == 0 else None

    def spent(self, step: int) -> bool:
        """True once, at the step where the job should stop."""
        if self.budget_s is None or step >= self.max_steps:
            return False
        now, done = self.clock(), step - self.first_step + 1
        if done == self.warmup_steps:
            self._t_steady = now
        steady = done - self.warmup_steps
        if steady < MIN_STEADY_STEPS_SLOW or now - self._t0 < self.budget_s:
            return False
        steady_s = now - self._t_steady if self._t_steady is not None else 0.0
        if steady < MIN_STEADY_STEPS and steady_s < max(self.budget_s, SLOW_STEADY_S):
            return False
        self.stopped_at = step
        log.info(f"time budget: stopped at step {step} of {self.max_steps} after {self.budget_s:g} s "
                 f"(ablation.budget_s={self.budget_s:g}); its figures are the median of the steady steps run so far")
        return True

    def summary(self) -> dict[str, object]:
        """The ``budget`` entry of summary.json: absent when the job had no budget."""
        if self.budget_s is None:
            return {}
        return {"budget": {"budget_s": self.budget_s, "planned_steps": self.max_steps,
                           "stopped_at_budget": self.stopped_at is not None, "stopped_at_step": self.stopped_at,
                           "min_steady_steps": MIN_STEADY_STEPS, "min_steady_steps_slow": MIN_STEADY_STEPS_SLOW,
                           "steady_steps": (self.stopped_at - self.first_step + 1 - self.warmup_steps
                                            if self.stopped_at is not None else None),
                           "method": "measured within a time budget, not the full step count"}}
