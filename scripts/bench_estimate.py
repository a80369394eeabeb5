#!/usr/bin/env python3
"""The CPU time of one memory estimate (``perfrun estimate``'s unit of work: it makes one, and
up to a dozen more when the configuration does not fit) with the memory tracker's statistics
kept in perfrun's :class:`~perfrun.memory.tracker.ModuleStats` and in torch's own
dictionary, alternated in one process so that both see the same machine.

    python scripts/bench_estimate.py [--layers N] [--repeats R]

The default shape is GPT-2 small (12 layers) at batch 16 x 1024, as gpu-check estimates it.
Printed: each side's CPU seconds (time.process_time, one thread), their medians and the
ratio; the two estimates' figures must be identical, or it exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.config import TrainConfig  # noqa: E402
from perfrun.memory import estimate as estimating  # noqa: E402
from perfrun.memory import tracker as memory_tracker  # noqa: E402
from perfrun.memory.preflight import GPT2_SHAPE  # noqa: E402


def one(cfg: TrainConfig, stats: type) -> tuple[float, dict]:
    memory_tracker.ModuleStats = stats  # what CategoryTracker gives the tracker
    c0 = time.process_time()
    e = estimating.estimate(cfg, 50257, top=5)
    seconds = time.process_time() - c0
    figures = {k: v for k, v in e.to_dict().items() if k != "seconds"}
    return seconds, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = estimating.variant(TrainConfig(), **{**GPT2_SHAPE, "model.n_layer": args.layers}, device="cpu")
    ours, torchs = memory_tracker.ModuleStats, type("TorchDictionary", (WeakIdKeyDictionary,), {})
    one(cfg, ours)  # the first estimate of a process also imports and warms the fake-tensor machinery
    times: dict[str, list[float]] = {"perfrun ModuleStats": [], "torch WeakIdKeyDictionary": []}
    for _ in range(args.repeats):
        a, fa = one(cfg, ours)
        b, fb = one(cfg, torchs)
        if fa != fb:
            print("the two estimates differ:", fa, fb, file=sys.stderr)
            return 1
        times["perfrun ModuleStats"].append(a)
        times["torch WeakIdKeyDictionary"].append(b)
    memory_tracker.ModuleStats = ours
    print(f"GPT-2 shape, {args.layers} layers, batch 16 x 1024, CPU seconds per estimate "
          f"(torch {torch.__version__}, one thread):")
    for name, ts in times.items():
        print(f"  {name:<27} median {statistics.median(ts):6.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
    ratio = statistics.median(times["torch WeakIdKeyDictionary"]) / statistics.median(times["perfrun ModuleStats"])
    pairs = [b / a for a, b in zip(times["perfrun ModuleStats"], times["torch WeakIdKeyDictionary"], strict=True)]
    print(f"  torch's / perfrun's: {ratio:.2f}x (pairs {min(pairs):.2f}x to {max(pairs):.2f}x); "
          f"peak {fa['peak_bytes']:,} B in both")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
