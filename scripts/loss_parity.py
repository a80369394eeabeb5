#!/usr/bin/env python3
"""Loss parity of one run against another: did a knob (fp8 against bf16) train the same?

    python scripts/loss_parity.py BASE_RUN OTHER_RUN [--window FRACTION] [--tolerance FRACTION]

Each RUN is a job folder with metrics.jsonl. The comparison is the ladder's
(:func:`perfrun.ladder.analysis.loss_parity`): the mean train loss over the last ``--window`` of
the steps both logged, as a relative difference, and the largest relative difference at any
common step. One line, for the digest of ``scripts/gpu_bench.sh``; with ``--tolerance``, exit
status 1 when the mean's relative difference is larger (docs/memory-knobs.md: 8/4-bit AdamW's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.console import error  # noqa: E402
from perfrun.ladder.analysis import DEFAULT_LOSS_WINDOW, loss_parity, train_losses  # noqa: E402
from perfrun.summary import read_summary  # noqa: E402


def describe(job: Path) -> str:
    """The run's precision and model, from its summary.json (its folder's name without one)."""
    try:
        cfg = dict(read_summary(job)).get("config") or {}
    except (OSError, ValueError):
        return job.name
    return f"{(cfg.get('precision') or {}).get('name', '?')} {(cfg.get('optim') or {}).get('name', '?')} " \
           f"{(cfg.get('model') or {}).get('name', '?')} {(cfg.get('data') or {}).get('name', '?')}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--window", type=float, default=DEFAULT_LOSS_WINDOW,
                    help="tail fraction of the common logged steps averaged (default %(default)s)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="exit 1 when the mean train loss differs by more than this fraction")
    args = ap.parse_args(argv)
    base, other = train_losses(args.base), train_losses(args.other)
    for job, losses in ((args.base, base), (args.other, other)):
        if not losses:
            error(f"{job} has no train losses in metrics.jsonl; give the folder of a run that trained")
            return 2
    p = loss_parity(other, base, args.window)
    if p["rel_diff"] is None:
        error(f"{args.base} and {args.other} logged no step in common; run both with the same log_every")
        return 2
    print(f"loss parity {describe(args.other)} vs {describe(args.base)}: mean train loss over steps "
          f"{p['steps'][0]}-{p['steps'][1]} {p['loss']:.4f} vs {p['baseline_loss']:.4f} ({p['rel_diff']:+.2%}); "
          f"largest gap at one step {p['max_rel_diff']:.2%}"
          + ("" if args.tolerance is None else f"; tolerance {args.tolerance:.2%}: "
             + ("within" if abs(p["rel_diff"]) <= args.tolerance else "EXCEEDED")))
    return 1 if args.tolerance is not None and abs(p["rel_diff"]) > args.tolerance else 0


if __name__ == "__main__":
    raise SystemExit(main())
