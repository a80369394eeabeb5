"""``profile=true``: torch.profiler over a few steady-state steps; ``memory_snapshot=true``:
the CUDA allocator's history, dumped for PyTorch's memory viewer.

Both attach to the plan as step hooks and undo themselves on the job's exit stack, so
the loop knows neither by name.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from perfrun.config import ConfigError, TrainConfig

log = logging.getLogger("perfrun")


def _top_ops(prof: profile, key: str, rows: int = 15) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def gpu_busy(trace: Path) -> dict[str, float]:
    """How busy the GPU was over the recorded steps of a Chrome trace: the time covered by
    kernels (overlapping ones merged) over the steps' span on the device timeline.

    Each step is marked twice, on the host (``user_annotation``) and on the device
    (``gpu_user_annotation``); the device marks bound the kernels. Far below 100 % means
    the GPU waited for the host (launches, Python, hooks), not for arithmetic.
    """
    opener = gzip.open if trace.name.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    marks = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    steps = [e for e in marks if e.get("cat") == "gpu_user_annotation"]
    if not steps:
        raise ValueError(f"{trace}: no step marks on the device timeline (a CUDA profile=true trace has them)")
    t0, t1 = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "kernel" and t0 <= e["ts"] < t1)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            covered += min(b, t1) - max(a, end)
            end = b
    n = len(steps)
    return {"steps": n, "wall_ms_per_step": (t1 - t0) / n / 1000, "kernel_ms_per_step": covered / n / 1000,
            "gpu_busy_pct": 100 * covered / (t1 - t0), "kernels_per_step": len(spans) / n}


def attach_profiler(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack, run_dir: Path | None,
                    record: bool = True) -> None:
    """Record steps ``start_step+warmup+1 ..`` for ``active`` steps; write a Chrome trace
    (open in https://ui.perfetto.dev), a TensorBoard trace and the top operators by self
    device time (``top_ops.txt``, CUDA) and by self host time (``top_ops_cpu.txt``). On CUDA
    the summary gets how busy the GPU was over those steps (:func:`gpu_busy`).

    Under several ranks every rank checks the settings (so all refuse alike) and rank 0
    alone records (``record``): the ranks run the same program, and one trace is read.
    """
    if not cfg.profile:
        return
    p = cfg.profiler  # its window was checked before the job built anything (:func:`check`)
    if not record:
        return
    if run_dir is None:
        raise ConfigError("profile=true needs a run dir to write its traces into; run through perfrun train")
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
        trace = out / ("trace.json" + (".gz" if written.name.endswith(".gz") else ""))
        shutil.copyfile(written, trace)
        table = _top_ops(prof, "self_cuda_time_total" if cuda else "self_cpu_time_total")
        (out / "top_ops.txt").write_text(table)
        if cuda:
            (out / "top_ops_cpu.txt").write_text(_top_ops(prof, "self_cpu_time_total"))
        log.info(f"profiler: trace in {trace} (ui.perfetto.dev), TensorBoard in {out / 'tensorboard'}; "
                 f"top operators by self {'device' if cuda else 'CPU'} time:\n{table}")
        if cuda:
            try:
                busy = gpu_busy(trace)
            except (ValueError, KeyError, OSError) as e:  # a trace without device marks: no figure, no failure
                log.warning(f"profiler: no GPU-busy figure ({e})")
                return
            plan.notes["profile"]["gpu"] = busy
            log.info(f"profiler: the GPU ran kernels {busy['gpu_busy_pct']:.1f} % of the profiled steps "
                     f"({busy['kernel_ms_per_step']:.2f} of {busy['wall_ms_per_step']:.2f} ms per step, under the "
                     f"profiler); well below 100 % means it waited for the host: see {out / 'top_ops_cpu.txt'}")

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


def check(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse a profiler window past the run's end and an allocator history off CUDA, before
    anything is built."""
    p = cfg.profiler
    if cfg.profile and p.start_step + p.warmup + p.active > cfg.max_steps:
        raise ConfigError(
            f"profile=true records steps {p.start_step + p.warmup + 1}-{p.start_step + p.warmup + p.active} "
            f"but max_steps={cfg.max_steps}; raise max_steps or lower profiler.start_step/warmup/active"
        )
    if cfg.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"memory_snapshot=true records the CUDA allocator; device is {device}: use a CUDA device or drop it")


def start_memory_history(cfg: TrainConfig, device: torch.device, stack: ExitStack) -> bool:
    """Record the CUDA allocator's history from setup on (before the model is built);
    :func:`dump_memory_snapshot` writes it at the end and on an out-of-memory error. Off CUDA
    it was refused before (:func:`check`, with the run's other refusals)."""
    if not cfg.memory_snapshot:
        return False
    # the underscore names are torch's documented snapshot API (pytorch.org/docs: torch_cuda_memory)
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
