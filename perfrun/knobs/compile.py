"""``torch.compile`` with the chosen options; compile caches are reset when the job ends.

``compile_options.scope``: ``model`` compiles the module the loop calls (the whole GPT, or
its DDP wrapper, whose gradient buckets then split the graph); ``blocks`` compiles each
transformer block's ``forward`` on its own, leaving the module's hooks outside the graph:
what FSDP2 needs, since its all-gather and reduce-scatter hooks run around each block.
``auto`` is ``blocks`` under FSDP and ``model`` otherwise. Either way the state dict keeps
the plain model's names.
"""

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
    scope = opts.scope if opts.scope != "auto" else ("blocks" if cfg.distributed == "fsdp" else "model")
    options = {"mode": None if opts.mode == "default" else opts.mode, "fullgraph": bool(opts.fullgraph),
               "dynamic": opts.dynamic}
    if scope == "model":
        plan.model = torch.compile(plan.model, **options)
    else:
        for block in plan.raw_model.blocks:
            block.forward = torch.compile(block.forward, **options)  # maybe checkpoint-wrapped already
            stack.callback(block.__dict__.pop, "forward", None)
    stack.callback(torch.compiler.reset)
    plan.notes["compile_options"] = {"mode": opts.mode, "fullgraph": bool(opts.fullgraph), "dynamic": opts.dynamic,
                                     "scope": scope}
