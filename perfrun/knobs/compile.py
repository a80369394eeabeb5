"""``torch.compile`` with the chosen options; compile caches are reset when the job ends."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from typing import Any

import torch

from perfrun.config import ConfigError


def apply(cfg: Any, device: torch.device, plan: Any, stack: ExitStack) -> None:
    plan.notes["compile"] = bool(cfg.compile)
    if not cfg.compile:
        return
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        raise ConfigError(
            "compile=true on the CPU needs a C++ compiler (inductor builds C++ kernels) and none is on PATH; "
            "install one (apt-get install g++) or set compile=false"
        )
    opts = cfg.compile_options
    plan.model = torch.compile(
        plan.model, mode=None if opts.mode == "default" else opts.mode,
        fullgraph=bool(opts.fullgraph), dynamic=opts.dynamic,
    )
    stack.callback(torch.compiler.reset)
    plan.notes["compile_options"] = {"mode": opts.mode, "fullgraph": bool(opts.fullgraph), "dynamic": opts.dynamic}
