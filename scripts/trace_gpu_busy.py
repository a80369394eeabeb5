#!/usr/bin/env python3
"""How busy the GPU was in a ``profile=true`` trace: kernel time over the wall time of the
profiled steps on the device timeline.

    python scripts/trace_gpu_busy.py RUN_DIR/profile/trace.json [...]

A step whose kernels cover far less than its wall time was waiting on the host (launch
overhead, Python, hooks), not on the GPU's arithmetic. A run with ``profile=true`` on CUDA
reports the same figures in its summary (``knobs.profile.gpu``); this reads saved traces.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.telemetry.profiling import gpu_busy  # noqa: E402


def main() -> int:
    for arg in sys.argv[1:]:
        try:
            b = gpu_busy(Path(arg))
        except (OSError, ValueError, KeyError) as e:
            print(f"trace_gpu_busy: {arg}: {e}", file=sys.stderr)
            return 2
        print(f"{arg}: {b['steps']} steps, {b['wall_ms_per_step']:.2f} ms/step wall, "
              f"{b['kernel_ms_per_step']:.2f} ms/step in kernels, GPU busy {b['gpu_busy_pct']:.1f} %, "
              f"{b['kernels_per_step']:.0f} kernels/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
