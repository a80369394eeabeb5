"""Offloading to host memory (``offload=activations|optimizer``), CUDA only.

- ``activations``: every tensor the forward saves for the backward is copied to pinned host
  memory and back when the backward needs it (``torch.autograd.graph.save_on_cpu``): the
  activations leave the GPU, at the cost of two copies over PCIe per saved tensor.
- ``optimizer``: the optimizer's state lives on the host and its step runs there (torchao's
  ``CPUOffloadOptimizer``: each gradient copied to the host as it is accumulated, the updated
  parameter copied back after the step); the GPU holds no optimizer state.

A CPU run has nothing to offload to, and is refused. Neither is measured on a GPU yet.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig


def check(cfg: TrainConfig, device: torch.device) -> None:
    """One line for an offload the run cannot do, before any data or model is built."""
    name = cfg.offload.name
    if name == "none":
        return
    if device.type != "cuda":
        raise ConfigError(f"offload={name}: a {device.type} run already keeps everything in host memory, so there is "
                          "nothing to offload to; use offload=none (or device=cuda)")
    if name == "optimizer" and cfg.distributed != "none":
        raise ConfigError(f"offload=optimizer with distributed={cfg.distributed}: torchao's CPUOffloadOptimizer is for "
                          "one GPU; use offload=none")


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    """Activations: the forward runs under ``save_on_cpu`` (the tensors it saves are packed when
    saved, so the context need only span the forward). The optimizer's offload is built with
    the optimizer (perfrun/optim/adamw.py)."""
    name = cfg.offload.name
    if name == "none":
        return
    check(cfg, device)
    if name == "activations":
        plan.contexts.append(partial(torch.autograd.graph.save_on_cpu, pin_memory=True))
    plan.notes["offload"] = name
