"""Repeats and the noise floor: a figure measured several times is its median and its spread
(min-max), and a difference between two such figures is an effect only when their ranges do
not overlap. Anything else is printed as "no measurable effect (±x %)", never as a speed-up.

A figure measured once has no spread of its own. Where the machine's noise was measured in
the same sweep (``floor_pct``: the same configuration run twice), a single run is given that
noise around its figure, so a gap wider than the noise is an effect whatever the repeat count;
one inside it is "inside the machine's noise", never "no measurable effect" (one run cannot
show that). Without the machine's noise a single run's effect is unknown (None), not a tie.

Pure maths over lists of numbers: the ladder, the runs table and ``perfrun tune`` share it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from perfrun.report.rows import finite


@dataclass(frozen=True)
class Spread:
    """Median and range of the repeats of one measurement (repeats not measured to have had
    the machine to themselves, contended or unknown, left out by the caller)."""

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
    measurable: bool | None  # None: a side ran once and the machine's noise is not known
    single: bool = False  # a side ran once: its range is the machine's noise, not its own spread

    def text(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.measurable is None:
            return f"{self.ratio:.2f}× (1 run: no spread)"
        if not self.measurable:
            return (f"inside the machine's noise (±{self.noise_pct:.1f}%, 1 run)" if self.single
                    else f"no measurable effect (±{self.noise_pct:.1f}%)")
        return f"{self.ratio:.2f}× (±{self.noise_pct:.1f}%" + (", 1 run)" if self.single else ")")


def _range(s: Spread, floor_pct: float | None) -> tuple[float, float] | None:
    """The range ``s`` is known to within: its min-max, widened to the machine's noise where
    that is larger; the machine's noise alone around a single run; None where neither is known."""
    half = None if floor_pct is None else s.median * floor_pct / 100.0  # type: ignore[operator]
    if s.n >= 2:
        lo, hi = s.lo, s.hi
        if half is not None:
            lo, hi = min(lo, s.median - half), max(hi, s.median + half)  # type: ignore[operator]
        return lo, hi  # type: ignore[return-value]
    return None if half is None else (s.median - half, s.median + half)  # type: ignore[operator]


def effect(a: Spread, b: Spread, floor_pct: float | None = None) -> Effect:
    """``a`` over ``b``. Measurable only when the two ranges are disjoint (:func:`_range`: the
    repeats' min-max, or the machine's noise ``floor_pct`` (± % of a median) where that is
    wider or a side ran once): a smaller difference is inside what one configuration varies by."""
    if a.median is None or not b.median:
        return Effect(None, None, None)
    ratio = a.median / b.median
    ra, rb = _range(a, floor_pct), _range(b, floor_pct)
    single = a.n < 2 or b.n < 2
    if ra is None or rb is None:
        return Effect(ratio, None, None, single)
    noise = 100.0 * ((ra[1] - ra[0]) / 2 + (rb[1] - rb[0]) / 2) / b.median
    return Effect(ratio, noise, ra[0] > rb[1] or ra[1] < rb[0], single)


#: A repeat whose tokens/s is this many times off the median of its rung's repeats
#: (either way; with two repeats, the slower of a pair this far apart) is an outlier.
OUTLIER_RATIO = 1.5


def outliers(values: Sequence[float]) -> list[int]:
    """Indices of the repeats far outside the others (:data:`OUTLIER_RATIO`). With two, only
    the slower can be named: a neighbour slows a job down, nothing speeds one up."""
    v = list(values)
    if len(v) == 2:
        lo, hi = (0, 1) if v[0] <= v[1] else (1, 0)
        return [lo] if v[lo] > 0 and v[hi] / v[lo] > OUTLIER_RATIO else []
    if len(v) < 3:
        return []
    mid = statistics.median(v)
    return [i for i, x in enumerate(v) if x <= 0 or mid <= 0 or max(x / mid, mid / x) > OUTLIER_RATIO]


def clear_winner(groups: dict[str, Spread]) -> str | None:
    """The key whose range lies above every other's (an effect outside the noise), or None."""
    ranked = sorted((k for k, s in groups.items() if s.median is not None), key=lambda k: -groups[k].median)  # type: ignore[operator]
    if not ranked:
        return None
    if len(ranked) == 1:
        return ranked[0]
    top, second = groups[ranked[0]], groups[ranked[1]]
    return ranked[0] if effect(top, second).measurable is not False else None
