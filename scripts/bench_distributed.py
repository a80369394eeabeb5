#!/usr/bin/env python3
"""What the distributed wrappers cost on one device: the same job as a plain process,
under DDP and under FSDP2 (each a world of one), run side by side in one process.

    python scripts/bench_distributed.py [--steps N] [--warmup W] [--modes none,ddp,fsdp] [hydra overrides ...]

A mode may carry its own overrides after ``+``: ``--modes none,fsdp,fsdp+fsdp.reshard_after_forward=false``.

With one rank there is nothing to talk to, so this measures each wrapper's own cost:
DDP's gradient buckets and hooks, FSDP2's per-block all-gather/reduce-scatter machinery
and its mixed-precision casts. It prints tokens/s, peak memory and the final loss of each,
and the ratios against the plain run (speed; memory; loss difference). Scaling over
several GPUs needs several GPUs: run ``perfrun train -m distributed=ddp,fsdp nproc=1,N``.
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
)
from perfrun.train import run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default="none,ddp,fsdp")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    register_configs()
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        name, *extra = mode.split("+")
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose("train", overrides=[f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}",
                                              "progress=off", f"eval_every={args.steps}", "eval_batches=2",
                                              "checkpoint.at_end=false", "monitor.every_n_steps=0",
                                              *args.overrides, f"distributed={name}", *extra])
        with tempfile.TemporaryDirectory() as d:
            s = run(cfg, Path(d))
        rows.append({"distributed": mode, "tokens_per_s": s["tokens_per_s_median"], "step_ms": s["step_time_ms_median"],
                     "mfu": s["mfu_median"], "peak_mem_mib": s["peak_mem_mib"], "first_step_s": s["first_step_s"],
                     "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
                     "knobs": s["knobs"], "device": s["environment"]["device_name"]})
    base = rows[0]
    print(f"config: {' '.join(args.overrides) or '(defaults)'}; {args.steps} steps ({args.warmup} warm-up); "
          f"device {base['device']}")
    width = max(11, *(len(r["distributed"]) for r in rows))
    print(f"{'distributed':>{width}} {'tokens/s':>12} {'ms/step':>9} {'MFU %':>6} {'peak MiB':>10} {'val loss':>9} "
          f"{'speed ratio':>11} {'mem ratio':>9}")
    for row in rows:
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}"
        row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["mem_ratio"] = row["peak_mem_mib"] / base["peak_mem_mib"]
        print(f"{row['distributed']:>{width}} {row['tokens_per_s']:>12,.0f} {row['step_ms']:>9.2f} {mfu:>6} "
              f"{row['peak_mem_mib']:>10,.0f} {row['final_val_loss']:>9.4f} {row['speed_ratio']:>11.3f} "
              f"{row['mem_ratio']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
