#!/usr/bin/env python3
"""Each memory knob against the same run without it, alternating, in one process: the
category of memory it frees, the bytes per parameter or per token, and its speed cost.

    python scripts/bench_memory_knobs.py [--steps N] [--repeats R] [--knobs NAME,...] [--json FILE]
                                         [hydra overrides ...]

The overrides set the base (default: a 2-block, 128-wide GPT on synthetic tokens, batch 8 x 64
on the CPU, ``optim.grad_clip=0`` throughout: the step in the backward needs it, and the base
must not pay for a clip the knob leaves out). Each repeat runs the base and every knob in
turn, the order reversed on odd repeats, so a drift of a shared machine hits every knob
alike. Each job tracks one step after its warm-up under torch's memory tracker
(``memory.breakdown=true``, kept out of tokens/s): the category a knob frees is the one that
shrinks most against the base's tracked step, given per parameter (parameters, gradients,
optimizer state) or per token of a micro-batch (activations, temporaries). The speed is the
median, over repeats, of the knob's tokens/s over the base's of the same repeat, with the
smallest and largest of those ratios. Offloading is for CUDA; a CPU run lists it as not
measured (nothing to offload to).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.config import config_dir, register_configs, typed  # noqa: E402
from perfrun.ladder.memory_plot import freed  # noqa: E402
from perfrun.loop.run import run  # noqa: E402

BASE = ["model=tiny", "model.n_layer=2", "data=synthetic", "data.vocab_size=256", "data.seq_len=64",
        "dataloader.batch_size=8", "device=cpu", "optim.grad_clip=0", "eval_every=0", "eval_batches=1",
        "log_every=5", "progress=off", "monitor.every_n_steps=0", "checkpoint.at_end=false",
        "memory.breakdown=true"]
KNOBS = {  # name -> the overrides it adds to the base
    "checkpointing=full": ["checkpointing=full"],
    "checkpointing=selective": ["checkpointing=selective"],
    "accumulation.steps=2 (half batch)": ["accumulation.steps=2", "dataloader.batch_size=4"],
    "loss=chunked": ["loss=chunked", "loss.chunk_size=128"],
    "optim=adamw8bit": ["optim=adamw8bit"],
    "optim=adamw4bit": ["optim=adamw4bit"],
    "optim.in_backward=true": ["optim.in_backward=true"],
}
CUDA_ONLY = {"offload=activations": "CUDA only (a CPU run has nothing to offload to)",
             "offload=optimizer": "CUDA only (a CPU run has nothing to offload to)"}
PER_PARAMETER = ("Parameter", "Gradient", "Optstate")


def compose_cfg(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return typed(compose("train", overrides=overrides))


def job(overrides: list[str], folder: Path) -> dict[str, Any]:
    s = run(compose_cfg(overrides), folder)
    b = (s.get("memory") or {}).get("breakdown") or {}
    return {"tokens_per_s": s.get("tokens_per_s_median"), "peak_bytes": b.get("peak_bytes"),
            "memory_breakdown": {"categories_bytes": b.get("categories_bytes") or {}}, "params": s.get("params"), "tokens": s.get("tokens_per_step"),
            "micro_steps": (s.get("knobs") or {}).get("accumulation_steps", 1)}


def per_unit(base: dict[str, Any], knob: dict[str, Any], name: str) -> tuple[str, float, str]:
    """The category that shrank most against the base (:func:`perfrun.ladder.memory_plot.freed`,
    the ladder's reading), its bytes, and that per parameter or per micro-batch token."""
    found = freed(name, knob, base)
    if found is None or found[1] <= 0:
        return "none", 0.0, "-"
    category, saved = found
    if category in PER_PARAMETER:
        return category, saved, f"{saved / base['params']:.2f} B/parameter"
    return category, saved, f"{saved / (base['tokens'] // base['micro_steps']):.0f} B/token"  # the base's micro-batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--knobs", default=",".join(KNOBS), help="the knobs measured, by name (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base_words = [*BASE, f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}", *args.overrides]
    chosen = [k for k in args.knobs.split(",") if k]
    unknown = [k for k in chosen if k not in KNOBS]
    if unknown:
        ap.error(f"--knobs: {', '.join(unknown)} not among {', '.join(KNOBS)}")
    names = ["base", *chosen]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else list(reversed(names)):
                words = base_words + ([] if name == "base" else KNOBS[name])
                runs[name].append(job(words, Path(tmp) / f"{r}-{len(runs[name])}-{names.index(name)}"))
                print(f"repeat {r}: {name}: {runs[name][-1]['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    rows = []
    base0 = runs["base"][0]
    print(f"base: {' '.join(base_words)}")
    print(f"base: {base0['params']:,} parameters, peak {base0['peak_bytes'] / 2**20:.2f} MiB at the tracked step, "
          f"{statistics.median(j['tokens_per_s'] for j in runs['base']):.0f} tok/s (median of {args.repeats})")
    print(f"{'knob':<36} {'frees':<11} {'bytes':>10} {'per param/token':>16} {'peak MiB':>9} "
          f"{'speed':>6} {'min-max':>12}")
    for name in chosen:
        category, saved, per = per_unit(base0, runs[name][0], name)
        ratios = [k["tokens_per_s"] / b["tokens_per_s"] for k, b in zip(runs[name], runs["base"], strict=True)]
        row = {"knob": name, "frees": category, "bytes": saved, "per": per,
               "peak_bytes": runs[name][0]["peak_bytes"], "speed": statistics.median(ratios),
               "speed_min": min(ratios), "speed_max": max(ratios), "repeats": len(ratios)}
        rows.append(row)
        print(f"{name:<36} {category:<11} {saved / 2**20:>7.2f} MiB {per:>16} {row['peak_bytes'] / 2**20:>9.2f} "
              f"{row['speed']:>5.2f}x {row['speed_min']:>5.2f}-{row['speed_max']:.2f}x")
    for name, why in CUDA_ONLY.items():
        print(f"{name:<36} not measured here: {why}")
    if args.json:
        args.json.write_text(json.dumps({"base": base_words, "base_runs": runs["base"], "rows": rows,
                                         "not_measured": CUDA_ONLY}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
