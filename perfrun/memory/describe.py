"""An estimate in words: the lines ``perfrun estimate`` prints and the train log's first
line, each saying it is an estimate (never a measurement)."""

from __future__ import annotations

from perfrun.config import TrainConfig
from perfrun.memory.estimate import Estimate
from perfrun.memory.fit import gib
from perfrun.memory.tracker import CATEGORIES


def mib_or_gib(n: float) -> str:
    return gib(n)


def describe(cfg: TrainConfig, e: Estimate) -> list[str]:
    """The estimate of ``cfg``: the peak by category and the modules holding most."""
    b = e.breakdown
    knobs = (f"precision={cfg.precision.name} checkpointing={cfg.checkpointing.name} loss={cfg.loss.name}"
             + (f" distributed=fsdp nproc={e.world} (one rank's share)" if e.world > 1 else ""))
    lines = [
        f"ESTIMATE, not a measurement: fake tensors under {b.method}, nothing allocated ({e.seconds:.1f} s)",
        f"model={cfg.model.name} batch {e.batch_size} x {e.seq_len} tokens, accumulation {e.micro_steps}, {knobs}, "
        f"for {e.target}",
        f"  estimated peak  {mib_or_gib(e.peak_bytes):>12}",
    ]
    for name in CATEGORIES:
        v = b.categories.get(name, 0)
        share = 100 * v / e.peak_bytes if e.peak_bytes else 0.0
        lines.append(f"    {name:<12} {mib_or_gib(v):>12}  {share:5.1f} %")
    if b.modules:
        lines.append("  modules holding most (parameters + activations their forward leaves for the backward):")
        lines += [f"    {m.name:<14} {mib_or_gib(m.held):>12}  (parameters {mib_or_gib(m.parameter_bytes)}, "
                  f"activations {mib_or_gib(m.activation_bytes)})" for m in b.modules]
    if cfg.checkpointing.name != "none":
        lines.append("  under activation checkpointing the recomputed activations are counted as Temp "
                     "(Activation + Temp is the figure to read; the peak is right)")
    if e.not_counted:
        lines.append("  not counted: " + "; ".join(e.not_counted))
    return lines


def fit_line(e: Estimate, limit: int | None, where: str, largest: tuple[int, int] | None, cap: int) -> str:
    """Whether it fits ``limit`` and the largest batch that does (estimates)."""
    if limit is None:
        return f"  fits: not judged ({where}); give memory.size=80GiB to fit into a GPU's memory"
    verdict = (f"fits, {gib(limit - e.peak_bytes)} to spare" if e.peak_bytes <= limit
               else f"does NOT fit, {gib(e.peak_bytes - limit)} over")
    text = f"  in {gib(limit)} ({where}): {verdict}"
    if largest is not None:
        batch, runs = largest
        shown = f"{batch}" + (f" or more (the search stops at {cap})" if batch >= cap else "")
        text += (f"; largest batch that fits: {shown} ({runs} estimates)" if batch
                 else "; not even batch 1 fits")
    return text
