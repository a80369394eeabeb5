"""``torch.compile`` with the chosen options; compile caches are reset when the job ends.

``compile_options.scope``: ``model`` compiles the module the loop calls (the whole GPT, or
its DDP wrapper, whose gradient buckets then split the graph; under FSDP2 the graph breaks
at each block's all-gather and reduce-scatter hooks); ``blocks`` compiles each
transformer block's ``forward`` on its own, with the module hooks outside the graph (the
torchtitan recipe for FSDP). ``model`` is the default because it measured the faster of the
two under none, DDP and FSDP alike (BENCHMARKS.md: ``compile_options.scope``).
Either way the state dict keeps the plain model's names.

``compile_options.mode``: ``default``; ``max-autotune-no-cudagraphs`` (inductor benchmarks
kernel choices, no CUDA graphs); ``reduce-overhead`` and ``max-autotune`` replay CUDA
graphs, which the step path allows: shapes never change (``drop_last``, a fixed batch),
no host sync inside a step, and the compiled call takes only the batch (the loss function
and its chunk size are constants of the model). With CUDA graphs, each optimizer step
starts a new graph generation (``cudagraph_mark_step_begin``) before its first micro-batch,
so outputs the last step left behind are known to be dead, while the gradients its
micro-batches accumulate stay alive to the optimizer (marking after a step instead would
leave a job's first step to inductor's own generations, which free the first
micro-batch's gradients when the second forward starts: ``torch.compiler.reset`` at a
job's end zeroes the mark counter).
"""

from __future__ import annotations

import logging
import shutil
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig
from perfrun.knobs.refusal import need

log = logging.getLogger("perfrun")

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
#: What a CUDA-graph mode amounts to on a device without CUDA graphs.
WITHOUT_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def next_graph_generation(step: int) -> None:
    """Before a step: it starts a new CUDA graph generation."""
    torch.compiler.cudagraph_mark_step_begin()


def eager() -> AbstractContextManager[Any]:
    """Compiled code runs eagerly inside. The auto-batch trials and eval call the plain
    model, whose blocks ``scope=blocks`` compiled in place: without this each trial's batch
    and eval's no-grad mode would compile anew (minutes on a GPU, and past inductor's
    recompile limit the chosen batch would run eagerly for the whole run)."""
    return torch.compiler.set_stance("force_eager")


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    plan.notes["compile"] = bool(cfg.compile)
    if not cfg.compile:
        return
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        raise ConfigError(
            "compile=true on the CPU needs a C++ compiler (inductor builds C++ kernels) and none is on PATH; "
            "install one (apt-get install g++) or set compile=false"
        )
    opts = cfg.compile_options
    scope = opts.scope
    options = {"mode": None if opts.mode == "default" else opts.mode, "fullgraph": bool(opts.fullgraph),
               "dynamic": opts.dynamic, "backend": opts.backend}
    if scope == "model":
        plan.model = torch.compile(plan.model, **options)
    else:
        need(plan.raw_model, "blocks", "compile_options.scope=blocks")
        for block in plan.raw_model.blocks:
            block.forward = torch.compile(block.forward, **options)  # maybe checkpoint-wrapped already
            stack.callback(block.__dict__.pop, "forward", None)
    graphs = opts.mode in CUDA_GRAPH_MODES and device.type == "cuda"
    if graphs:
        plan.step_start_hooks.append(next_graph_generation)
    elif opts.mode in CUDA_GRAPH_MODES:
        log.warning(f"compile_options.mode={opts.mode} replays CUDA graphs, which the {device.type} does not have: "
                    f"here it compiles as mode={WITHOUT_GRAPHS[opts.mode]} would")
    stack.callback(torch.compiler.reset)
    plan.notes["compile_options"] = {"mode": opts.mode, "fullgraph": bool(opts.fullgraph), "dynamic": opts.dynamic,
                                     "scope": scope, "cuda_graphs": graphs}
