"""The answer in other trainers' words, as the report renders it: the trainers, the line that
points to ``perfrun report PATH --as``, and the translated texts a report carries.

The translations themselves are the ladder's (:mod:`perfrun.ladder.translate`); they reach the
renderers as data on the :class:`~perfrun.report.rows.Report`, so this package knows no ladder.
"""

from __future__ import annotations

import os

from perfrun.report.rows import Report

TRAINERS = ("hf", "lightning", "torch")
AS_CHOICES = (*TRAINERS, "perfrun")
TRAINER_NAMES = {"hf": "Hugging Face Trainer", "lightning": "Lightning", "torch": "plain PyTorch loop"}


def as_hint(where: str, run: bool = False) -> str:
    """The line that says where the answer in another trainer's words is."""
    choices = "|".join(AS_CHOICES if run else TRAINERS)
    return f"in your trainer's words: perfrun report {where} --as {choices}"


def where(report: Report) -> str:
    """The directory a one-root report is of: its jobs' common folder."""
    return os.path.commonpath([str(p) for p in report.paths.values()]) if report.paths else "."
