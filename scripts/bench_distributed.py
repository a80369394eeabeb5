#!/usr/bin/env python3
"""What the distributed wrappers cost on one device: the same job as a plain process,
under DDP and under FSDP2 (each a world of one), run side by side in one process.

    python scripts/bench_distributed.py [--steps N] [--warmup W] [--modes none,ddp,fsdp] [hydra overrides ...]
    python scripts/bench_distributed.py --models gpt2,gpt2-medium,gpt2-large,gpt2-xl --compile both \\
        [--gpu-busy] data=synthetic device=cuda precision=bf16

A mode may carry its own overrides after ``+``: ``--modes none,fsdp,fsdp+fsdp.reshard_after_forward=false``.

With one rank there is nothing to talk to, so this measures each wrapper's own cost:
DDP's gradient buckets and hooks, FSDP2's per-block all-gather/reduce-scatter machinery
and its mixed-precision casts. It prints tokens/s, peak memory and the final loss of each,
and the ratios against the plain run (speed; memory; loss difference). Scaling over
several GPUs needs several GPUs: run ``perfrun train -m distributed=ddp,fsdp nproc=1,N``.

``--models`` sizes FSDP2's host overhead against the model: for each model (at a batch
that fits one 80 GB GPU, ``BATCH``) and each of eager / compiled, the plain job, FSDP2 as it
was (every group resharded after forward, implicit prefetch) and FSDP2 with the settings
that trim its host work (``TUNED``: last block and root kept, prefetching 2 blocks ahead
both ways, each block compiled with the hooks outside), then one line per model and
compile setting with the fsdp/plain ratios side by side. ``--gpu-busy`` profiles 3 steps
inside the timing warm-up (so the tokens/s exclude them) and adds the share of those steps
the GPU ran kernels (CUDA only).
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

# sequences per step at seq 1024 with bf16 autocast: gpt2 at 16 peaked at 18 GB eager on an H100;
# activations grow with layers x width, so gpt2-xl (48 x 1600, 25 GB of weights and AdamW state) takes 8
BATCH = {"tiny": 16, "gpt2": 16, "gpt2-medium": 16, "gpt2-large": 16, "gpt2-xl": 8}
AS_IT_WAS = "fsdp+fsdp.reshard_last_block=true"
TUNED = ("fsdp+fsdp.forward_prefetch=2+fsdp.backward_prefetch=2+compile_options.scope=blocks")
SIZING_MODES = {"plain": "none", "fsdp": AS_IT_WAS, "fsdp-tuned": TUNED}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default=None, help="default: none,ddp,fsdp; with --models: plain, fsdp, fsdp-tuned")
    ap.add_argument("--models", default=None, help="comma-separated model presets, each at its BATCH")
    ap.add_argument("--compile", choices=("false", "true", "both"), default=None,
                    help="eager, compiled or both (default: what the overrides say)")
    ap.add_argument("--gpu-busy", action="store_true", help="profile 3 warm-up steps per job: GPU busy %% (CUDA)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.gpu_busy and args.warmup < 6:
        ap.error(f"--gpu-busy profiles steps warmup-4..warmup-2, which needs --warmup 6 or more (got {args.warmup})")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no steady steps of --steps {args.steps}; raise --steps")
    return args


def run_job(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """One job in this process, in a scratch run dir; its figures."""
    busy = ["profile=true", f"profiler.start_step={args.warmup - 6}", "profiler.warmup=1", "profiler.active=3",
            "profiler.record_shapes=false"] if args.gpu_busy else []
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=[f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}",
                                          "progress=off", f"eval_every={args.steps}", "eval_batches=2",
                                          "checkpoint.at_end=false", "monitor.every_n_steps=0", *busy, *overrides])
    with tempfile.TemporaryDirectory() as d:
        s = run(typed(cfg), Path(d))
    gpu = (s["knobs"].get("profile") or {}).get("gpu") or {}
    return {"tokens_per_s": s["tokens_per_s_median"], "step_ms": s["step_time_ms_median"], "mfu": s["mfu_median"],
            "peak_mem_mib": s["peak_mem_mib"], "first_step_s": s["first_step_s"],
            "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
            "gpu_busy_pct": gpu.get("gpu_busy_pct"), "knobs": s["knobs"], "device": s["environment"]["device_name"]}


def print_rows(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """One line per job, ratios against ``base`` (the plain job of the same group)."""
    width = max(11, *(len(r["distributed"]) for r in rows))
    print(f"{'distributed':>{width}} {'tokens/s':>12} {'ms/step':>9} {'MFU %':>6} {'peak MiB':>10} {'val loss':>9} "
          f"{'speed ratio':>11} {'mem ratio':>9} {'GPU busy %':>10}")
    for row in rows:
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}"
        busy = "-" if row["gpu_busy_pct"] is None else f"{row['gpu_busy_pct']:.1f}"
        row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["mem_ratio"] = row["peak_mem_mib"] / base["peak_mem_mib"]
        print(f"{row['distributed']:>{width}} {row['tokens_per_s']:>12,.0f} {row['step_ms']:>9.2f} {mfu:>6} "
              f"{row['peak_mem_mib']:>10,.0f} {row['final_val_loss']:>9.4f} {row['speed_ratio']:>11.3f} "
              f"{row['mem_ratio']:>9.3f} {busy:>10}")


def print_sizing(groups: list[dict[str, Any]], labels: list[str]) -> None:
    """Per model and compile setting: tokens/s of each mode and its ratio to the plain job."""
    head = " ".join(f"{label + ' tok/s':>16} {'ratio':>6}" for label in labels)
    print(f"\n{'model':>12} {'batch':>5} {'compile':>7} {head}  GPU busy % ({' / '.join(labels)})")
    for g in groups:
        cells = " ".join(f"{r['tokens_per_s']:>16,.0f} {r['speed_ratio']:>6.3f}" for r in g["rows"])
        busy = " / ".join("-" if r["gpu_busy_pct"] is None else f"{r['gpu_busy_pct']:.1f}" for r in g["rows"])
        print(f"{g['model']:>12} {g['batch']:>5} {g['compile']:>7} {cells}  {busy}")


def main() -> int:
    args = parse_args()
    register_configs()
    models = args.models.split(",") if args.models else [None]
    compiles = {"both": ["false", "true"], None: [None]}.get(args.compile, [args.compile])
    if args.modes:
        modes = {m: m for m in args.modes.split(",")}
    else:
        modes = SIZING_MODES if args.models else {m: m for m in ("none", "ddp", "fsdp")}
    groups: list[dict[str, Any]] = []
    for model in models:
        for compiled in compiles:
            first = ([f"model={model}", f"dataloader.batch_size={BATCH.get(model, 8)}"] if model else []) + (
                [f"compile={compiled}"] if compiled else [])
            rows = []
            for label, mode in modes.items():
                name, *extra = mode.split("+")
                rows.append({"distributed": label, "mode": mode,
                             **run_job(args, [*first, *args.overrides, f"distributed={name}", *extra])})
            group = {"model": model or "-", "rows": rows, "compile": str(bool(rows[0]["knobs"]["compile"])).lower(),
                     "batch": next((o.split("=")[1] for o in reversed([*first, *args.overrides])
                                    if o.startswith("dataloader.batch_size=")), "-"),
                     "overrides": [*first, *args.overrides]}
            print(f"\nconfig: {' '.join(group['overrides']) or '(defaults)'}; {args.steps} steps ({args.warmup} "
                  f"warm-up); device {rows[0]['device']}")
            print_rows(rows, rows[0])
            groups.append(group)
    if args.models or len(groups) > 1:
        print_sizing(groups, list(modes))
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "steps": args.steps, "groups": groups,
                                         "rows": [r for g in groups for r in g["rows"]]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
