#!/usr/bin/env python3
"""Does the GPU wait for its data? ``gpu_starved_pct`` for four input paths, in one process.

    python scripts/bench_starvation.py --memmap DIR [--steps N] [--warmup W] [--sleep-ms S]
                                       [--out DIR] [--json FILE] [hydra overrides ...]

The overrides set the base (e.g. ``model=gpt2 dataloader.batch_size=16 device=cuda
precision=bf16 compile=true``). Cases, each one ``perfrun.loop.run.run`` with the base:

  synthetic         data=synthetic: on CUDA the tokens are drawn on the device; the figure is
                    the time the GPU spent drawing them between steps (about 0)
  memmap            data=memmap data.path=DIR (train.bin/val.bin/meta.json, as ``perfrun
                    prepare`` writes them): copied one batch ahead on a side stream
  slow, 0 workers   the same memmap source, each window read S ms late (a sleep before every
                    window, the deliberately slow host source), read in the main process
  slow, 2 workers   the same slow source read by 2 DataLoader workers, persistent

The slow source is made here, not in perfrun: ``Windows.__getitem__`` (every host source's
window read) is wrapped with a sleep for the two slow cases only, and the DataLoader's
workers are forked from this process, so they read through the wrapper too. Printed per case:
``gpu_starved_pct`` (CUDA: the share of the step the GPU waited for its batch; n/a on the
CPU), ``host_data_wait_pct`` (the host's wait for the DataLoader) and tokens/s. Each run's
folder (summary.json, metrics.jsonl) is kept under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speed import compose_cfg  # noqa: E402

from perfrun.checkpoint.atomic import write_json  # noqa: E402
from perfrun.console import error  # noqa: E402
from perfrun.data.windows import Windows  # noqa: E402
from perfrun.loop.run import run  # noqa: E402

WORKERS = "dataloader.num_workers={n} dataloader.persistent_workers={p} dataloader.pin_memory=true"


def cases(memmap: Path) -> list[tuple[str, list[str], bool]]:
    """(name, overrides, slow source) of each case, in the order they run."""
    mm = ["data=memmap", f"data.path={memmap}"]
    return [
        ("synthetic", ["data=synthetic", *WORKERS.format(n=0, p="false").split()], False),
        ("memmap", [*mm, *WORKERS.format(n=0, p="false").split()], False),
        ("slow, 0 workers", [*mm, *WORKERS.format(n=0, p="false").split()], True),
        ("slow, 2 workers", [*mm, *WORKERS.format(n=2, p="true").split()], True),
    ]


@contextlib.contextmanager
def slow_windows(sleep_s: float) -> Iterator[None]:
    """Every host source's window read ``sleep_s`` late, until the block ends."""
    read = Windows.__getitem__

    def late(self: Windows, index: int) -> Any:
        time.sleep(sleep_s)
        return read(self, index)

    Windows.__getitem__ = late  # type: ignore[method-assign]
    try:
        yield
    finally:
        Windows.__getitem__ = read  # type: ignore[method-assign]


def one_case(overrides: list[str], slow: bool, sleep_s: float, out: Path) -> dict[str, Any]:
    with slow_windows(sleep_s) if slow else contextlib.nullcontext():
        s = run(compose_cfg(overrides), out)
    return {"gpu_starved_pct": s.get("gpu_starved_pct"), "host_data_wait_pct": s.get("host_data_wait_pct"),
            "tokens_per_s": s.get("tokens_per_s_mean"), "step_time_ms_median": s.get("step_time_ms_median"),
            "input": (s.get("knobs") or {}).get("input"), "device": s["environment"]["device_name"],
            "status": s.get("status"), "run_dir": str(out)}


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}%"


def print_table(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    device = next(iter(table.values()))["device"]
    print(f"base: {' '.join(args.overrides) or '(defaults)'}; steps {args.steps}, warm-up {args.warmup}; "
          f"slow source: {args.sleep_ms:g} ms before each window; device {device}")
    print(f"{'case':<18} {'gpu_starved':>12} {'host wait':>10} {'tokens/s':>11}  input")
    for name, r in table.items():
        tps = "n/a" if r["tokens_per_s"] is None else format(r["tokens_per_s"], ",.0f")
        print(f"{name:<18} {_pct(r['gpu_starved_pct']):>12} {_pct(r['host_data_wait_pct']):>10} {tps:>11}  {r['input']}")
    print("starvation: " + ", ".join(f"{n} {_pct(r['gpu_starved_pct'])}" for n, r in table.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memmap", type=Path, required=True, help="a folder perfrun prepare wrote (train.bin, meta.json)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--sleep-ms", type=float, default=2.0, help="the slow source's delay before each window")
    ap.add_argument("--out", type=Path, help="keep each case's run folder here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if not (args.memmap / "train.bin").is_file():
        error(f"--memmap {args.memmap} has no train.bin; make it with: "
              f"perfrun prepare path=README.md out={args.memmap} tokenizer=byte")
        return 2
    if multiprocessing.get_start_method() != "fork":
        error(f"the slow source needs DataLoader workers forked from this process, but the start method is "
              f"{multiprocessing.get_start_method()}; run on Linux")
        return 2
    common = [f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}", "progress=off",
              f"eval_every={args.steps}", "eval_batches=1", "checkpoint.at_end=false", "monitor.every_n_steps=0",
              *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        table = {name: one_case([*common, *extra], slow, args.sleep_ms / 1000, root / name.replace(", ", "_").replace(" ", "_"))
                 for name, extra, slow in cases(args.memmap)}
    print_table(table, args)
    if args.json:
        write_json(args.json, {"base": args.overrides, "steps": args.steps, "warmup": args.warmup,
                               "sleep_ms": args.sleep_ms, "memmap": str(args.memmap), "cases": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
