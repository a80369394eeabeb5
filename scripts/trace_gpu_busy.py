#!/usr/bin/env python3
"""How busy the GPU was in a ``profile=true`` trace: kernel time over the wall time of the
profiled steps, and the host time per step in the top-level CPU ops.

    python scripts/trace_gpu_busy.py RUN_DIR/profile/trace.json [...]

A step whose kernels cover far less than its wall time was waiting on the host (launch
overhead, Python, hooks), not on the GPU's arithmetic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def busy(trace: Path) -> dict[str, float]:
    events = json.loads(trace.read_text())["traceEvents"]
    marks = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    # each step is marked twice: on the host ("user_annotation") and, on CUDA, on the device
    # timeline ("gpu_user_annotation"), which is where its kernels run: use that one
    steps = [e for e in marks if e.get("cat") == "gpu_user_annotation"] or [
        e for e in marks if e.get("cat") == "user_annotation"]
    if not steps:
        raise SystemExit(f"{trace}: no ProfilerStep events; is it a perfrun profile=true trace?")
    t0, t1 = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and t0 <= e["ts"] < t1]
    # kernels may overlap on several streams: merge their intervals before summing
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            covered += b - max(a, end)
            end = b
    return {"steps": len(steps), "wall_ms_per_step": (t1 - t0) / len(steps) / 1000,
            "kernel_ms_per_step": covered / len(steps) / 1000, "gpu_busy_pct": 100 * covered / (t1 - t0),
            "kernels_per_step": len(kernels) / len(steps)}


def main() -> int:
    for arg in sys.argv[1:]:
        b = busy(Path(arg))
        print(f"{arg}: {b['steps']} steps, {b['wall_ms_per_step']:.2f} ms/step wall, "
              f"{b['kernel_ms_per_step']:.2f} ms/step in kernels, GPU busy {b['gpu_busy_pct']:.1f} %, "
              f"{b['kernels_per_step']:.0f} kernels/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
