"""What fits a memory size: for a configuration that does not fit, which knob would make it fit and by how much.
Every figure here is an estimate (:mod:`perfrun.memory.estimate`), said so wherever shown."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig
from perfrun.memory.estimate import Estimate, EstimateError, estimate, variant

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, key: str = "memory.size") -> int:
    """``80GiB``, ``40 GB``, ``81920MiB``, ``12.5GiB`` -> bytes; ConfigError with the fix otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{key}={text} is not a memory size; write a number and a unit, e.g. {key}=80GiB "
                          f"(units: {', '.join(u for u in ('GiB', 'GB', 'MiB', 'MB'))})")
    return int(float(m.group(1)) * UNITS[unit])


def gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_limit(size: str | None) -> tuple[int | None, str]:
    """The memory to fit into: ``memory.size`` if given, else the visible GPU's; None on a
    machine without one (nothing to fit into), with where the figure came from."""
    if size is not None:
        return parse_size(size), f"memory.size={size}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"{props.name}'s memory"
    return None, "no GPU visible and no memory.size given"


@dataclass
class KnobFit:
    """One knob's change and the estimate it gives."""

    overrides: str  # as the user would type them
    peak_bytes: int
    fits: bool
    error: str | None = None


def knob_changes(cfg: TrainConfig) -> list[tuple[str, dict[str, Any]]]:
    """The knobs that take memory away, each as (the overrides, the changed keys), in the
    order a user would try them: what costs least speed first."""
    out: list[tuple[str, dict[str, Any]]] = []
    if cfg.loss.name != "chunked":
        out.append(("loss=chunked", {"loss.name": "chunked"}))
    if cfg.precision.name == "none":
        out.append(("precision=bf16", {"precision.name": "bf16", "precision.dtype": "bfloat16"}))
    if cfg.checkpointing.name != "full":
        out.append(("checkpointing=full", {"checkpointing.name": "full", "checkpointing.every_k": 1}))
    b, acc = int(cfg.dataloader.batch_size), int(cfg.accumulation.steps)
    if b > 1:
        half = b // 2
        out.append((f"dataloader.batch_size={half} accumulation.steps={acc * 2}",
                    {"dataloader.batch_size": half, "accumulation.steps": acc * 2}))
    if cfg.distributed == "none":
        for n in (2, 4, 8):
            out.append((f"distributed=fsdp nproc={n}", {"distributed": "fsdp", "nproc": n}))
    return out


def what_fits(cfg: TrainConfig, vocab_size: int, limit: int, *, first: bool = False) -> list[KnobFit]:
    """Each knob of :func:`knob_changes` estimated alone (``first``: until one fits); an
    FSDP width is tried only until one fits. An estimate that cannot be made is listed with
    its reason."""
    out: list[KnobFit] = []
    fsdp_fits = False
    for words, changes in knob_changes(cfg):
        if first and any(f.fits for f in out):
            break
        if words.startswith("distributed=fsdp") and fsdp_fits:
            continue
        try:
            e = estimate(variant(cfg, **changes), vocab_size, top=0)
        except (EstimateError, ConfigError) as err:
            out.append(KnobFit(words, 0, False, str(err)))
            continue
        out.append(KnobFit(words, e.peak_bytes, e.peak_bytes <= limit))
        fsdp_fits = fsdp_fits or (words.startswith("distributed=fsdp") and e.peak_bytes <= limit)
    return out


def advice(base: Estimate, limit: int, where: str, fixes: list[KnobFit]) -> str:
    """One line: what would make ``base`` fit, and by how much (or that nothing tried does)."""
    over = base.peak_bytes - limit
    fitting = [f for f in fixes if f.fits]
    if not fitting:
        return (f"estimated peak {gib(base.peak_bytes)} is {gib(over)} over {where} ({gib(limit)}); no single knob tried "
                "makes it fit: combine them, or a smaller model or data.seq_len")
    best = min(fitting, key=lambda f: f.peak_bytes)
    first = fitting[0]
    shown = first if first is best else best
    return (f"estimated peak {gib(base.peak_bytes)} is {gib(over)} over {where} ({gib(limit)}); {first.overrides} "
            f"makes it fit ({gib(first.peak_bytes)}, {gib(limit - first.peak_bytes)} free)"
            + ("" if shown is first else f"; {best.overrides} saves most ({gib(best.peak_bytes)})"))
