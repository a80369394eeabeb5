"""What a run refuses from its configuration and device alone, before it builds data or a
model: every knob's check, the low-bit optimizer's, the profiler's. Setup calls it once the
device is known; ``perfrun train`` calls it before Hydra makes a single run's run dir, so a
refused run leaves no folder behind."""

from __future__ import annotations

import torch

from perfrun.config import TrainConfig
from perfrun.knobs import check_knobs
from perfrun.optim import low_bit
from perfrun.telemetry import profiling


def refuse_before_building(cfg: TrainConfig, device: torch.device) -> None:
    """Raise ConfigError (one line: what, why, the fix) for a setting this run cannot take."""
    check_knobs(cfg, device)
    low_bit.check(cfg.optim, cfg.distributed)
    profiling.check(cfg, device)
