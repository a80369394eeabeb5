#!/usr/bin/env python3
"""What the telemetry monitor costs: the same run with ``monitor.every_n_steps=1`` and
with ``0``, alternated R times in one process, median step times compared.

    python scripts/bench_monitor.py [--steps N] [--repeats R] [hydra overrides ...]

Target: the monitored run is less than 1% slower (ratio of median tokens/s >= 0.99).
The monitor's own accounting (sampler thread CPU time + collect time, from summary.json)
is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.config import (
    config_dir,  # noqa: E402
    register_configs,  # noqa: E402
    typed,  # noqa: E402
)
from perfrun.loop.run import run  # noqa: E402
from perfrun.telemetry.step_metrics import median  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    register_configs()
    rows: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for every in (0, 1) if r % 2 == 0 else (1, 0):  # alternate the order against drift
            with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
                cfg = compose("train", overrides=[f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}",
                                                  "progress=off", f"eval_every={args.steps}", "eval_batches=1",
                                                  "checkpoint.at_end=false", *args.overrides,
                                                  f"monitor.every_n_steps={every}"])
            with tempfile.TemporaryDirectory() as d:
                s = run(typed(cfg), Path(d))
            mon = s.get("monitor") or {}
            rows.append({"repeat": r, "every_n_steps": every, "tokens_per_s": s["tokens_per_s_median"],
                         "step_ms": s["step_time_ms_median"], "monitor_overhead_s": mon.get("monitor_overhead_s"),
                         "train_time_s": s["train_time_s"], "device": s["environment"]["device_name"]})
    print(f"config: {' '.join(args.overrides) or '(defaults)'}; {args.steps} steps x {args.repeats} repeats; "
          f"device {rows[0]['device']}")
    print(f"{'repeat':>6} {'every_n':>8} {'tokens/s':>12} {'ms/step':>9} {'monitor s':>10}")
    for row in rows:
        ov = row["monitor_overhead_s"]
        print(f"{row['repeat']:>6} {row['every_n_steps']:>8} {row['tokens_per_s']:>12,.0f} {row['step_ms']:>9.3f} "
              f"{'-' if ov is None else format(ov, '.3f'):>10}")
    on = median([r["tokens_per_s"] for r in rows if r["every_n_steps"] == 1])
    off = median([r["tokens_per_s"] for r in rows if r["every_n_steps"] == 0])
    ratio = on / off
    print(f"median tokens/s: monitor every step {on:,.0f}, monitor off {off:,.0f}; ratio = {ratio:.4f} "
          f"({100 * (1 - ratio):+.2f}% slower; target < 1%: {'met' if ratio >= 0.99 else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ratio": ratio, "overrides": args.overrides}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
