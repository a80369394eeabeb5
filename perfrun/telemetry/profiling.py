"""``profile=true``: torch.profiler over a few steady-state steps; ``memory_snapshot=true``:
the CUDA allocator's history, dumped for PyTorch's memory viewer.

Both attach to the plan as step hooks and undo themselves on the job's exit stack, so
the loop knows neither by name.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from perfrun.config import ConfigError

log = logging.getLogger("perfrun")


def _top_ops(prof: profile, cuda: bool, rows: int = 15) -> str:
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def attach_profiler(cfg: Any, device: torch.device, plan: Any, stack: ExitStack, run_dir: Path | None) -> None:
    """Record steps ``start_step+warmup+1 ..`` for ``active`` steps; write a Chrome trace
    (open in https://ui.perfetto.dev), a TensorBoard trace and the top operators by self
    device time (self CPU time on the CPU)."""
    if not cfg.profile:
        return
    p = cfg.profiler
    if run_dir is None:
        raise ConfigError("profile=true needs a run dir to write its traces into; run through perfrun train")
    if p.start_step + p.warmup + p.active > cfg.max_steps:
        raise ConfigError(
            f"profile=true records steps {p.start_step + p.warmup + 1}-{p.start_step + p.warmup + p.active} "
            f"but max_steps={cfg.max_steps}; raise max_steps or lower profiler.start_step/warmup/active"
        )
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tensorboard = tensorboard_trace_handler(str(out / "tensorboard"), worker_name="perfrun")

    def ready(prof: profile) -> None:
        # Kineto saves a trace once: TensorBoard's handler writes it (a Chrome trace in
        # JSON), and trace.json is a copy under a name people can find.
        tensorboard(prof)
        written = max((out / "tensorboard").glob("*.pt.trace.json*"), key=lambda q: q.stat().st_mtime)
        shutil.copyfile(written, out / ("trace.json" + (".gz" if written.name.endswith(".gz") else "")))
        table = _top_ops(prof, cuda)
        (out / "top_ops.txt").write_text(table)
        log.info(f"profiler: trace in {out / 'trace.json'} (ui.perfetto.dev), TensorBoard in {out / 'tensorboard'}; "
                 f"top operators by self {'device' if cuda else 'CPU'} time:\n{table}")

    prof = profile(
        activities=activities,
        schedule=schedule(skip_first=p.start_step, wait=0, warmup=p.warmup, active=p.active, repeat=1),
        on_trace_ready=ready, record_shapes=p.record_shapes, profile_memory=p.profile_memory, with_stack=False,
    )
    prof.start()
    stack.callback(prof.stop)
    plan.step_hooks.append(lambda step: prof.step())
    plan.notes["profile"] = {"steps": [p.start_step + p.warmup + 1, p.start_step + p.warmup + p.active],
                             "dir": str(out)}


def start_memory_history(cfg: Any, device: torch.device, stack: ExitStack) -> bool:
    """Record the CUDA allocator's history from setup on (before the model is built);
    :func:`dump_memory_snapshot` writes it at the end and on an out-of-memory error."""
    if not cfg.memory_snapshot:
        return False
    if device.type != "cuda":
        raise ConfigError(f"memory_snapshot=true records the CUDA allocator; device is {device}: use a CUDA device or drop it")
    torch.cuda.memory._record_memory_history(max_entries=cfg.profiler.snapshot_entries)
    stack.callback(torch.cuda.memory._record_memory_history, enabled=None)
    return True


def dump_memory_snapshot(run_dir: Path | None, why: str) -> str | None:
    """Write the allocator history (open it at https://pytorch.org/memory_viz)."""
    if run_dir is None:
        return None
    path = run_dir / "memory_snapshot.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    log.info(f"memory snapshot ({why}) written to {path}; open it at https://pytorch.org/memory_viz")
    return str(path)
