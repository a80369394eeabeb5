"""Autocast in bf16 or fp16 (with a gradient scaler), or fp32 with TF32 switchable."""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_supported(device: torch.device, dtype: torch.dtype, name: str) -> None:
    """Fail early, with the fix, where the device cannot autocast to ``dtype``."""
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ConfigError(
                f"precision={name}: {torch.cuda.get_device_name(device)} has no native bf16; "
                "use precision=fp16 (with loss scaling) or precision=none"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if dtype == torch.float16 and (major, minor) < (5, 3):
            raise ConfigError(f"precision={name}: compute capability {major}.{minor} lacks fp16; use precision=none")
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device_type=device.type, dtype=dtype):
            pass
    if any("not supported" in str(w.message).lower() or "disabl" in str(w.message).lower() for w in caught):
        raise ConfigError(
            f"precision={name}: autocast to {dtype} is not supported on {device.type}; use precision=none"
        )


def check(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse TF32 off CUDA and a dtype the device cannot autocast to, before anything is built."""
    p = cfg.precision
    if p.tf32 and device.type != "cuda":
        raise ConfigError(f"precision.tf32=true needs a CUDA device (device is {device}); drop it")
    if p.dtype in DTYPES and DTYPES[p.dtype] != torch.float32:
        _check_supported(device, DTYPES[p.dtype], p.name)


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    check(cfg, device)
    p = cfg.precision
    dtype = DTYPES[p.dtype]
    plan.notes["precision"] = p.name
    plan.notes["autocast_dtype"] = str(dtype).removeprefix("torch.")

    if device.type == "cuda":
        prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = bool(p.tf32)
        torch.backends.cudnn.allow_tf32 = bool(p.tf32)
        stack.callback(_restore_tf32, prev)
        plan.notes["tf32"] = bool(p.tf32)
    if dtype == torch.float32:
        return
    plan.contexts.append(partial(torch.autocast, device_type=device.type, dtype=dtype))
    if dtype == torch.float16:  # the plan's backward and optimizer step then scale, unscale and skip
        plan.scaler = torch.amp.GradScaler(device.type)
        plan.notes["grad_scaler"] = True


def _restore_tf32(prev: tuple[bool, bool]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
