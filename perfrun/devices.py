"""The one device parser: ``auto | cpu | cuda | cuda:N``, checked against this machine."""

from __future__ import annotations

import torch

from perfrun.config import ConfigError


def resolve_device(spec: str) -> torch.device:
    """auto takes the current CUDA device where there is one; a CUDA device that this
    machine does not have, or any other kind, is refused with one line."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device={spec} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device={spec}: perfrun runs on cpu or cuda; use device=auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={spec}: no CUDA device is visible (torch {torch.__version__}, "
                          f"cuda {torch.version.cuda}); use device=cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ConfigError(
            f"device={spec}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
            "pick one of them (check CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
