"""Repeats and the noise floor: a figure measured several times is its median and its spread
(min-max), and a difference between two such figures is an effect only when their ranges do
not overlap. Anything else is printed as "no measurable effect (±x %)", never as a speed-up.

Pure maths over lists of numbers: the ladder, the runs table and ``perfrun tune`` share it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from perfrun.report.rows import finite


@dataclass(frozen=True)
class Spread:
    """Median and range of the repeats of one measurement (contended repeats left out)."""

    n: int
    median: float | None
    lo: float | None
    hi: float | None

    @property
    def half_pct(self) -> float | None:
        """Half the range as a share of the median, in %: the ±x of "median ±x %"."""
        if self.n < 2 or not self.median:
            return None
        return 100.0 * (self.hi - self.lo) / 2 / self.median  # type: ignore[operator]

    def text(self, spec: str = ",.0f") -> str:
        if self.median is None:
            return "n/a"
        half = self.half_pct
        return format(self.median, spec) + (f" ±{half:.1f}%" if half is not None else " (1 run)")


def spread(values: Iterable[Any]) -> Spread:
    """The Spread of the finite values among ``values``."""
    v = sorted(x for x in values if finite(x))
    if not v:
        return Spread(0, None, None, None)
    return Spread(len(v), statistics.median(v), v[0], v[-1])


@dataclass(frozen=True)
class Effect:
    """``a`` against ``b``: the ratio of medians, the noise around it, and whether it is real."""

    ratio: float | None
    noise_pct: float | None  # the two half-ranges together, as a share of b's median
    measurable: bool | None  # None: a side ran once, so no spread is known

    def text(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.measurable is None:
            return f"{self.ratio:.2f}× (1 run: no spread)"
        if not self.measurable:
            return f"no measurable effect (±{self.noise_pct:.1f}%)"
        return f"{self.ratio:.2f}× (±{self.noise_pct:.1f}%)"


def effect(a: Spread, b: Spread) -> Effect:
    """``a`` over ``b``. Measurable only when the two min-max ranges are disjoint: a smaller
    difference is inside what the repeats of one configuration already vary by."""
    if a.median is None or not b.median:
        return Effect(None, None, None)
    ratio = a.median / b.median
    if a.n < 2 or b.n < 2:
        return Effect(ratio, None, None)
    noise = 100.0 * ((a.hi - a.lo) / 2 + (b.hi - b.lo) / 2) / b.median  # type: ignore[operator]
    return Effect(ratio, noise, a.lo > b.hi or a.hi < b.lo)  # type: ignore[operator]


def clear_winner(groups: dict[str, Spread]) -> str | None:
    """The key whose range lies above every other's (an effect outside the noise), or None."""
    ranked = sorted((k for k, s in groups.items() if s.median is not None), key=lambda k: -groups[k].median)  # type: ignore[operator]
    if not ranked:
        return None
    if len(ranked) == 1:
        return ranked[0]
    top, second = groups[ranked[0]], groups[ranked[1]]
    return ranked[0] if effect(top, second).measurable is not False else None
