"""What fits a memory size: for a configuration that does not fit, which knob would make it fit and by how much.
Every figure here is an estimate (:mod:`perfrun.memory.estimate`), said so wherever shown."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig
from perfrun.memory.estimate import Estimate, EstimateError, estimate, target_device, variant

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
    speed: float | None = None  # tokens/s against the ladder's top rung, where a ladder measured it


def knob_changes(cfg: TrainConfig, target: str = "cpu") -> list[tuple[str, dict[str, Any]]]:
    """Every knob that takes memory away, each as (the overrides, the changed keys), in the
    order a user would try them: what is expected to cost least speed first (the order a
    ladder's measured costs replace, :func:`cheapest`). Offloading only for a CUDA target
    estimated on a visible GPU (``target`` is ``cuda`` then)."""
    out: list[tuple[str, dict[str, Any]]] = []
    alone = cfg.distributed == "none"
    if cfg.loss.name != "chunked":
        out.append(("loss=chunked", {"loss.name": "chunked"}))
    if cfg.precision.name == "none":
        out.append(("precision=bf16", {"precision.name": "bf16", "precision.dtype": "bfloat16"}))
    if alone and cfg.optim.name == "adamw" and cfg.offload.name != "optimizer":
        out += [(f"optim={name}", {"optim.name": name}) for name in ("adamw8bit", "adamw4bit")]
    if (alone and not cfg.optim.in_backward and int(cfg.accumulation.steps) == 1 and cfg.precision.name != "fp16"
            and cfg.offload.name != "optimizer"):
        out.append(("optim.in_backward=true optim.grad_clip=0", {"optim.in_backward": True, "optim.grad_clip": 0.0}))
    if cfg.checkpointing.name == "none":
        out.append(("checkpointing=selective", {"checkpointing.name": "selective", "checkpointing.every_k": 2}))
    if cfg.checkpointing.name != "full":
        out.append(("checkpointing=full", {"checkpointing.name": "full", "checkpointing.every_k": 1}))
    b, acc = int(cfg.dataloader.batch_size), int(cfg.accumulation.steps)
    if b > 1 and not cfg.optim.in_backward:
        half = b // 2
        out.append((f"dataloader.batch_size={half} accumulation.steps={acc * 2}",
                    {"dataloader.batch_size": half, "accumulation.steps": acc * 2}))
    if target == "cuda" and cfg.offload.name == "none":
        out.append(("offload=activations", {"offload.name": "activations"}))
        if alone and cfg.optim.name == "adamw" and not cfg.optim.in_backward:
            out.append(("offload=optimizer", {"offload.name": "optimizer"}))
    if alone:
        for n in (2, 4, 8):
            out.append((f"distributed=fsdp nproc={n}", {"distributed": "fsdp", "nproc": n}))
    return out


def what_fits(cfg: TrainConfig, vocab_size: int, limit: int, *, first: bool = False,
              costs: dict[str, float] | None = None) -> list[KnobFit]:
    """Each knob of :func:`knob_changes` estimated alone (``first``: until one fits); an
    FSDP width is tried only until one fits. An estimate that cannot be made is listed with
    its reason. ``costs``: a ladder's measured speed of each knob (:func:`ladder_speeds`)."""
    out: list[KnobFit] = []
    fsdp_fits = False
    _, target = target_device(cfg)
    visible = target == "cuda" and torch.cuda.is_available()
    for words, changes in knob_changes(cfg, "cuda" if visible else "cpu"):
        if first and any(f.fits for f in out):
            break
        if words.startswith("distributed=fsdp") and fsdp_fits:
            continue
        speed = measured_speed(words, costs or {})
        try:
            e = estimate(variant(cfg, **changes), vocab_size, top=0)
        except (EstimateError, ConfigError) as err:
            out.append(KnobFit(words, 0, False, str(err), speed))
            continue
        out.append(KnobFit(words, e.peak_bytes, e.peak_bytes <= limit, None, speed))
        fsdp_fits = fsdp_fits or (words.startswith("distributed=fsdp") and e.peak_bytes <= limit)
    if target == "cuda" and not visible and cfg.offload.name == "none":
        out.append(KnobFit("offload=activations|optimizer", 0, False,
                           "not estimated: offloading is estimated on a visible GPU (host and device apart)"))
    return out


def ladder_speeds(path: str) -> dict[str, float]:
    """Each memory trade-off's tokens/s over its ladder's top rung, from a ladder's
    sweep_summary.json (a sweep folder or the file): the knob's words as the rung names them
    (``ablation.knob``) -> the ratio (1.0: no cost). ConfigError when it holds no ladder."""
    file = Path(path) / "sweep_summary.json" if Path(path).is_dir() else Path(path)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"estimate.ladder={path}: not a readable sweep_summary.json ({e}); give the folder of a "
                          "ladder run with +sweep=ablation") from None
    speeds: dict[str, float] = {}
    for ladder in doc.get("ablation") or []:
        top = next((e.get("tokens_per_s") for e in ladder.get("ladder", []) if e.get("rung") == ladder.get("top")), None)
        for t in ladder.get("tradeoffs", []):
            if top and t.get("tokens_per_s") and t.get("rung") != ladder.get("top"):
                speeds[str(t["setting"])] = float(t["tokens_per_s"]) / float(top)
    if not speeds:
        raise ConfigError(f"estimate.ladder={path}: its sweep summary holds no measured memory trade-off; run the "
                          "ladder (perfrun train -m +sweep=ablation) and give its folder")
    return speeds


def measured_speed(words: str, speeds: dict[str, float]) -> float | None:
    """A knob's measured speed ratio: its words as a ladder rung names them (accumulation by
    its key alone: the rung's steps differ from the estimate's)."""
    if words in speeds:
        return speeds[words]
    key = words.split()[-1].split("=")[0] if words.startswith("dataloader.batch_size") else None
    return next((v for k, v in speeds.items() if key and k.startswith(key)), None)


def cheapest(fixes: list[KnobFit]) -> KnobFit | None:
    """The knob that fits at the least speed: the fastest measured by a ladder, else the first
    that fits in :func:`knob_changes`' order (expected cost, unmeasured)."""
    fitting = [f for f in fixes if f.fits]
    measured = [f for f in fitting if f.speed is not None]
    if measured:
        return max(measured, key=lambda f: f.speed or 0.0)
    return fitting[0] if fitting else None


def advice(base: Estimate, limit: int, where: str, fixes: list[KnobFit]) -> str:
    """One line: what would make ``base`` fit, and by how much (or that nothing tried does):
    the cheapest knob that fits (:func:`cheapest`), and the one that saves most."""
    over = base.peak_bytes - limit
    fitting = [f for f in fixes if f.fits]
    first = cheapest(fixes)
    if first is None:
        return (f"estimated peak {gib(base.peak_bytes)} is {gib(over)} over {where} ({gib(limit)}); no single knob tried "
                "makes it fit: combine them, or a smaller model or data.seq_len")
    best = min(fitting, key=lambda f: f.peak_bytes)
    cost = (f", {first.speed:.2f}x the ladder's tokens/s" if first.speed is not None else "")
    return (f"estimated peak {gib(base.peak_bytes)} is {gib(over)} over {where} ({gib(limit)}); {first.overrides} "
            f"makes it fit ({gib(first.peak_bytes)}, {gib(limit - first.peak_bytes)} free{cost})"
            + ("" if best is first else f"; {best.overrides} saves most ({gib(best.peak_bytes)})"))


def ranked(fixes: list[KnobFit]) -> list[str]:
    """The knobs by the peak each gives, lowest first, with the speed a ladder measured; the
    cheapest that fits marked (every figure an estimate but the speeds)."""
    best = cheapest(fixes)
    lines = []
    for f in sorted(fixes, key=lambda f: (f.error is not None, f.peak_bytes)):
        speed = f"{f.speed:.2f}x tokens/s (ladder)" if f.speed is not None else "speed: not measured here"
        shown = f.error if f.error else f"peak {gib(f.peak_bytes):>11}  {'fits' if f.fits else 'no':>4}  {speed}"
        lines.append(f"    {f.overrides:<48} {shown}" + ("   <- cheapest that fits" if f is best else ""))
    return lines
