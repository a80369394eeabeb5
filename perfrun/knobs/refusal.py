"""A knob the model cannot take: refused before any work, with one line that names the missing
piece of the model contract (perfrun.models.contract). The ladder skips such a rung."""

from __future__ import annotations

from torch import nn

from perfrun.config import ConfigError
from perfrun.models import contract


class KnobRefused(ConfigError):
    """A knob whose need the model does not meet (perfrun.models.contract), refused before
    any work; the ladder skips such a rung with ``reason``."""

    def __init__(self, knob: str, reason: str) -> None:
        super().__init__(reason)
        self.knob, self.reason = knob, reason


def need(model: nn.Module, capability: str, knob: str) -> None:
    """Raise KnobRefused naming the missing piece where ``model`` lacks what ``knob`` needs."""
    why = contract.missing(model, capability, knob)
    if why is not None:
        raise KnobRefused(knob, why)


def refuse_unmet(fits: list[contract.KnobFit]) -> None:
    """The first configured knob the model cannot take, as a KnobRefused."""
    first = contract.refused(fits)
    if first is not None:
        raise KnobRefused(first.knob, first.reason)
