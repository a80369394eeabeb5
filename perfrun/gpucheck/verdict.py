"""One line of gpu-check's verdict, and what the lines add up to.

A warning or failure must say what to do: :class:`Check` refuses one without a fix, so
no check can tell a user something is wrong and leave them there.
"""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
#: How N/A facts print in gpu-check's lines.
NA = "N/A"


@dataclass
class Check:
    """One line of the verdict."""

    section: str
    name: str
    status: str
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"check {self.name!r} is {self.status} without a fix")


def exit_code(checks: list[Check]) -> int:
    """1 when any check failed, else 0: warnings inform, failures stop a script."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def counts(checks: list[Check]) -> dict[str, int]:
    """How many checks ended in each status."""
    return {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
