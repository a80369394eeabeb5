"""Facts about this machine and process that every summary carries, and the global torch
state a job must leave as it found it."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import socket
import sys
from collections.abc import Iterator
from typing import Any

import torch

import perfrun


@contextlib.contextmanager
def environment_default(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the process environment for the block, where the caller left it unset,
    and unset again after: a switch a library reads from the environment, set for perfrun's
    call and not left behind for the rest of the caller's process."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def rank_info() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; a single process is rank 0 of 1."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def environment(device: torch.device) -> dict[str, Any]:
    import hydra
    import omegaconf

    env: dict[str, Any] = {
        "perfrun": perfrun.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hydra": hydra.__version__,
        "omegaconf": omegaconf.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "device_name": device_name(device),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_capability"] = f"{props.major}.{props.minor}"
        env["device_memory_gib"] = round(props.total_memory / 2**30, 2)
    return env


def global_state() -> dict[str, Any]:
    """The process-wide torch settings that knobs touch; a job must restore every one."""
    return {
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "grad_enabled": torch.is_grad_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
        "default_dtype": str(torch.get_default_dtype()),
        "compiled_frames": _compiled_frame_count(),
        "cuda_memory_allocated": torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
    }


def _compiled_frame_count() -> int | None:
    """Frames dynamo has compiled since its last reset (0 after torch.compiler.reset()).

    A private counter, read for diagnosis only: None where this torch lacks it. A process
    that has not imported dynamo has compiled nothing, and importing it only to read 0 would
    delay a fresh ``perfrun train``'s first check (a bad setting's one line would wait on it).
    """
    if "torch._dynamo" not in sys.modules:
        return 0
    # no public API counts compiled frames
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "FRAME_COUNTER", None)


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """torchao logs a warning for each optional CUDA kernel library it cannot load on a
    CPU-only machine; they are irrelevant to CPU int8 and would bury the output."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)


def torchao_available() -> bool:
    """Whether torchao (the optional extra behind fp8 training and int8 inference) imports here."""
    try:
        with quiet_torchao():
            import torchao.quantization  # noqa: F401
    except ImportError:
        return False
    return True
