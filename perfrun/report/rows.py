"""What a report is made of: one Row per job as its summary.json tells it, and the Report
of one or several run, sweep or tune directories."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Spoken:
    """One configuration of a report in every trainer's words, or why it cannot be
    (:mod:`perfrun.report.spoken`)."""

    title: str
    texts: dict[str, str]  # trainer -> code
    why_not: str | None = None


class ReportError(ValueError):
    """A bad path or option: one line, exit 2."""


@dataclass
class Row:
    """One job, as its summary.json tells it."""

    job: str  # its dir relative to the sweep dir (prefixed by the root when several are given)
    root: str  # the directory the user named, when several were given; "" for one
    overrides: list[str]
    status: str  # completed | failed | skipped | stopped (a signal) | missing | unreadable | running
    reason: str | None
    tokens_per_s: float | None  # median over the steady steps
    mfu: float | None  # fraction of the peak
    peak_mem_mib: float | None
    host_data_wait_pct: float | None  # the host's wait for the DataLoader (old runs: data_wait_pct)
    final_train_loss: float | None
    final_val_loss: float | None
    first_step_s: float | None
    peak_mem_source: str | None = None
    device_name: str | None = None
    software: str | None = None  # torch (and CUDA) versions the job ran with
    knobs: dict[str, Any] = field(default_factory=dict)
    swept: dict[str, str | None] = field(default_factory=dict)  # the swept keys' values
    best: bool = False
    repeat: int | None = None  # which repeat of its overrides (the ``repeat`` key)
    ablation: dict[str, Any] = field(default_factory=dict)  # the job's place in the ladder (config ablation)
    contended: bool | None = None  # did another process share the machine (summary contention)
    contention: list[str] = field(default_factory=list)  # the evidence
    device_type: str | None = None  # cuda | cpu | ...
    gpu_starved_pct: float | None = None  # CUDA: % of the step the GPU waited for its batch

    @property
    def quiet(self) -> bool:
        """Measured to have had the machine to itself: the only jobs whose speed is counted."""
        return self.contended is False

    @property
    def machine_unknown(self) -> bool:
        """Completed, but whether it had the machine is unknown (its summary.json has no
        contention figures): flagged, and never counted."""
        return self.status == "completed" and self.contended is None


@dataclass
class Report:
    """Rows of one or several dirs, the keys that vary between them, and the best row."""

    rows: list[Row]
    swept_keys: list[str]
    best: str | None  # job label of the highest tokens/s
    ladders: list[dict[str, Any]] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)  # repeats of the same overrides (reading.Group)
    paths: dict[str, Path] = field(default_factory=dict)  # job label -> job dir (not serialised)
    spoken: list[Spoken] = field(default_factory=list)  # the HTML's translations (not serialised)


#: keys that say how a job was run, not what it measured: never a swept key nor a knob of the verdict
#: (a stopped sweep resumed with resume=auto would otherwise differ from its first jobs in them)
HOW_RUN = ("resume", "hydra")


def how_run(key: str) -> bool:
    """Whether the dotted ``key`` is one of :data:`HOW_RUN` or under it (``hydra.sweep.dir``)."""
    return key.split(".")[0] in HOW_RUN


def override_key(override: str) -> tuple[str, str | None]:
    """``+ablation=bf16`` -> (``ablation``, ``bf16``); ``~key`` -> (``key``, None)."""
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), (value if sep else None)


def finite(v: Any) -> bool:
    """A real number that can be shown and compared (not None, a bool, NaN or infinite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
