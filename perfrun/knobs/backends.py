"""cudnn.benchmark and the SDPA backend choice."""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from perfrun.config import ConfigError, TrainConfig

_SDPA = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def check(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse an SDPA backend that cannot run here, before anything is built."""
    if cfg.sdpa_backend == "auto":
        return
    if cfg.attention != "sdpa":
        raise ConfigError(
            f"sdpa_backend={cfg.sdpa_backend} needs attention=sdpa (attention={cfg.attention}); "
            "drop sdpa_backend or set attention=sdpa"
        )
    if device.type != "cuda" and cfg.sdpa_backend in ("flash", "cudnn"):
        raise ConfigError(
            f"sdpa_backend={cfg.sdpa_backend} runs only on CUDA (device is {device}); "
            "use sdpa_backend=math, efficient or auto"
        )


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    check(cfg, device)
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = bool(cfg.cudnn_benchmark)
    stack.callback(setattr, torch.backends.cudnn, "benchmark", previous)
    plan.notes["cudnn_benchmark"] = bool(cfg.cudnn_benchmark)
    if cfg.sdpa_backend != "auto":
        plan.contexts.append(partial(sdpa_kernel, _SDPA[cfg.sdpa_backend]))
    plan.notes["attention"] = cfg.attention
    plan.notes["sdpa_backend"] = cfg.sdpa_backend
