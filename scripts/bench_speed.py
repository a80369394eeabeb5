#!/usr/bin/env python3
"""The speed knobs against the plain nanoGPT-recipe loop, alternating, in one process.

    python scripts/bench_speed.py [--steps N] [--warmup W] [--repeats R] [--json FILE]
                                  [--all-mode MODE] [--variants NAME,...] [hydra overrides ...]

The overrides set the base (e.g. ``model=gpt2 data=synthetic dataloader.batch_size=16
device=cuda precision=bf16 compile=true``). Each repeat runs, in turn, the plain loop of
scripts/bench_train.py (kept as it is: no new knob reaches it) and perfrun with:

  host input       dataloader.device_input=false: each batch copied when the step takes it
  perfrun          the base: on CUDA, batches copied ahead (host data) or drawn on the device
  loss=chunked     the chunked linear cross-entropy
  precision=fp8    torchao float8 (GPUs of compute capability 8.9 and up)
  compile modes    max-autotune-no-cudagraphs, reduce-overhead, max-autotune (compile=true)
  all (bf16)       every knob above that runs here but fp8, compile mode --all-mode
  all              the same with fp8

``--variants`` runs only the named ones (the plain loop always runs: every ratio is to it).
A variant that cannot run here is skipped with the reason; one that fails is named with its
error and the others go on. Each finished run is printed as it ends and, with ``--json``,
written at once, so a run stopped part-way keeps what it measured. Printed per variant: the
median over repeats of the mean tokens/s after the warm-up, the spread of the repeats
(± half their range, in % of the median, as perfrun report prints it), its ratio to the plain loop,
the bf16-equivalent MFU (nanoGPT's FLOPs per token x tokens/s over the H100's 989.5 TFLOPS
dense bf16, whatever the device and dtype) and the peak memory. ``--profile-best DIR`` then
runs the fastest perfrun variant once more under the profiler (``profile=true``) into DIR
and prints its top kernels by device time (DIR/profile/top_ops.txt; host time on the CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import plain_loop  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.config import config_dir, register_configs, typed  # noqa: E402
from perfrun.console import first_line  # noqa: E402
from perfrun.devices import resolve_device  # noqa: E402
from perfrun.environment import torchao_available  # noqa: E402
from perfrun.knobs import fp8  # noqa: E402
from perfrun.knobs.compilation import CUDA_GRAPH_MODES  # noqa: E402
from perfrun.loop.run import run  # noqa: E402
from perfrun.report.noise import spread  # noqa: E402

H100_BF16_TFLOPS = 989.5  # dense bf16, the datasheet figure nanoGPT's MFU divides by
COMPILE_MODES = ("max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


def compose_cfg(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return typed(compose("train", overrides=overrides))


def skip_reason(knobs: list[str], base: Any, device: torch.device) -> str | None:
    """Why this device (or the base) cannot run the variant's knobs; None where it can."""
    if "dataloader.device_input=false" in knobs and device.type != "cuda":
        return "the CPU has no copy to overlap: both input paths are the same loop there"
    if "precision=fp8" in knobs:
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        reason = fp8.refusal(device.type, cc, device.type == "cuda" and torchao_available(), gpu)
        if reason:
            return reason
    mode = next((k.split("=", 1)[1] for k in knobs if k.startswith("compile_options.mode=")), "default")
    if mode != "default" and not base.compile:
        return "compile modes need compile=true in the base"
    if mode in CUDA_GRAPH_MODES and device.type != "cuda":
        return f"{mode} replays CUDA graphs; the device is {device.type}"
    if mode == "max-autotune-no-cudagraphs" and device.type != "cuda" and not shutil.which("c++"):
        return "no C++ compiler for inductor on the CPU"
    return None


def variants(all_mode: str) -> list[tuple[str, list[str]]]:
    every = ["loss=chunked", f"compile_options.mode={all_mode}"]
    return [
        ("host input", ["dataloader.device_input=false"]),
        ("perfrun", []),
        ("loss=chunked", ["loss=chunked"]),
        ("precision=fp8", ["precision=fp8"]),
        *((f"mode={m}", [f"compile_options.mode={m}"]) for m in COMPILE_MODES),
        ("all (bf16)", every),
        ("all", [*every, "precision=fp8"]),
    ]


PLAIN = "plain (nanoGPT recipe)"


def runnable(knobs: list[str], base: Any, device: torch.device) -> list[str]:
    """For the 'all' rows: the knobs that run here (a compile mode that cannot falls back to
    default, and the row says which knobs it has)."""
    return [k for k in knobs if skip_reason([k], base, device) is None]


def perfrun_row(overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        s = run(compose_cfg(overrides), Path(d))
    return {"tokens_per_s": s["tokens_per_s_mean"], "peak_mem_mib": s["peak_mem_mib"],
            "flops_per_token": s["flops_per_token"], "gpu_starved_pct": s.get("gpu_starved_pct"),
            "device": s["environment"]["device_name"], "fp8_kept": (s["knobs"].get("fp8") or {}).get("kept_in_bf16")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--all-mode", default="max-autotune-no-cudagraphs", choices=("default", *COMPILE_MODES),
                    help="the compile mode of the 'all' rows")
    ap.add_argument("--variants", type=lambda v: [n.strip() for n in v.split(",") if n.strip()],
                    help="run only these variants (comma-separated names as printed; the plain loop always runs)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--profile-best", type=Path, metavar="DIR",
                    help="profile the fastest perfrun variant into DIR and print its top kernels")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    common = [f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}", "progress=off",
              f"eval_every={args.steps}", "eval_batches=1", "checkpoint.at_end=false", "monitor.every_n_steps=0",
              *args.overrides]
    base = compose_cfg(common)
    device = resolve_device(base.device)
    plan: list[tuple[str, list[str]]] = []
    skipped: dict[str, str] = {}
    chosen = variants(args.all_mode)
    if args.variants:
        unknown = [n for n in args.variants if n not in dict(chosen)]
        if unknown:
            print(f"bench_speed.py: no variant {', '.join(map(repr, unknown))}; the variants are "
                  f"{', '.join(repr(n) for n, _ in chosen)}", file=sys.stderr)
            return 2
        chosen = [(n, k) for n, k in chosen if n in args.variants]
    for name, knobs in chosen:
        if name == "all" and skip_reason(["precision=fp8"], base, device):
            skipped[name] = skip_reason(["precision=fp8"], base, device) or ""
            continue
        if name.startswith("all"):
            knobs = runnable(knobs, base, device)
            print(f"{name}: {' '.join(knobs) or '(the base)'}")
        reason = skip_reason(knobs, base, device)
        if reason:
            skipped[name] = reason
        else:
            plan.append((name, knobs))

    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for r in range(args.repeats):  # alternating, so drift on the machine hits every variant alike
        for name, knobs in [(PLAIN, None), *plan]:
            if name in failed:
                continue
            try:
                row = plain_loop(base, args.warmup) if knobs is None else perfrun_row([*common, *knobs])
            except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding; the others go on
                if knobs is None:
                    raise
                failed[name] = f"{type(e).__name__}: {first_line(e)}"
                print(f"failed {name} (repeat {r}): {failed[name]}", flush=True)
                continue
            rows.append({"repeat": r, "variant": name, **row})
            print(f"repeat {r} {name}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
            if args.json:
                partial = {"base": args.overrides, "repeats_done": r, "rows": rows, "failed": failed}
                args.json.write_text(json.dumps(partial, indent=2, default=str))
    result = report(rows, base, {**skipped, **{n: f"failed: {why}" for n, why in failed.items()}}, args)
    result["failed"] = failed
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.profile_best:
        profile_best(result["table"], dict(plan), common, args.profile_best)
    return 0


def profile_best(table: dict[str, dict[str, Any]], plan: dict[str, list[str]], common: list[str], out: Path) -> None:
    """The fastest perfrun variant (by median tokens/s) once more, profiled from step 10 of 16."""
    best = max((n for n in table if n in plan), key=lambda n: table[n]["tokens_per_s"])
    knobs = [*plan[best], "max_steps=16", "timing_warmup_steps=5", "eval_every=16", "profile=true",
             "profiler.start_step=10"]
    print(f"profiled: {best} ({' '.join(plan[best]) or 'the base'}) into {out}")
    run(compose_cfg([*common, *knobs]), out)
    top = out / "profile" / "top_ops.txt"
    print(f"top kernels of {best} ({top}):")
    print(top.read_text() if top.is_file() else f"no {top.name}: the profiler wrote nothing there")


def report(rows: list[dict[str, Any]], base: Any, skipped: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table (medians over repeats) and return it with every row."""
    fpt = next(r["flops_per_token"] for r in rows if "flops_per_token" in r)
    names = list(dict.fromkeys(r["variant"] for r in rows))  # the plain loop first
    table = {}
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        tps = spread(r["tokens_per_s"] for r in mine)
        table[name] = {"tokens_per_s": tps.median, "repeats": tps.n, "spread_pct": tps.half_pct,
                       "peak_mem_mib": mine[0].get("peak_mem_mib"), "fp8_kept": mine[0].get("fp8_kept"),
                       "gpu_starved_pct": mine[-1].get("gpu_starved_pct")}
    plain = table[names[0]]["tokens_per_s"]
    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"base: {' '.join(args.overrides) or '(defaults)'}; steps {args.steps}, warm-up {args.warmup}, "
          f"repeats {args.repeats}; device {device}; torch {torch.__version__}")
    print(f"{'variant':<32} {'tokens/s':>11} {'spread':>7} {'x plain':>8} {'bf16-eq MFU %':>13} {'peak MiB':>9}")
    for name, row in table.items():
        row["ratio"] = row["tokens_per_s"] / plain
        row["mfu_bf16_equivalent"] = fpt * row["tokens_per_s"] / (H100_BF16_TFLOPS * 1e12)
        mem = row["peak_mem_mib"]
        half = "1 run" if row["spread_pct"] is None else f"±{row['spread_pct']:.1f}%"
        print(f"{name:<32} {row['tokens_per_s']:>11,.0f} {half:>7} {row['ratio']:>8.3f} "
              f"{100 * row['mfu_bf16_equivalent']:>13.3f} {'n/a' if mem is None else format(mem, ',.0f'):>9}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return {"base": args.overrides, "device": device, "torch": torch.__version__, "flops_per_token": fpt,
            "h100_bf16_tflops": H100_BF16_TFLOPS, "table": table, "skipped": skipped, "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
