"""A ladder rung's job (``perfrun train -m +sweep=ablation``): run it, or skip it with the reason.

The trainer knows no ladder: it trains what it is given and refuses a knob the model cannot
take (:class:`perfrun.knobs.KnobRefused`). This module, called by the sweep's job, decides
per rung before any work: a rung whose knob cannot act on this device (TF32 on a CPU, FP8
without FP8 tensor cores) or on this model (checkpointing without repeated ``blocks``,
``loss=chunked`` without an output head, attention in a model that picks its own) is not run
(measured, it would be the rung below plus noise) and gets a ``skipped`` summary with the
reason. A knob the model cannot take that a rung only inherits from the rungs below it
(``loss=chunked`` under ``compile_mode``, the leave-one-outs, the trade-offs) is turned off
for that job, said in the log and in its overrides, so the rest of the ladder still measures.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.checkpoint.atomic import write_json
from perfrun.config import AblationConfig, ConfigError, TrainConfig, as_dict
from perfrun.device_conditions import device_kind, rung_applies
from perfrun.summary import RunSummary, read_summary

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from perfrun.checkpoint.resume_search import RunSearch
    from perfrun.memory.found_batches import FoundBatches

log = logging.getLogger("perfrun")

#: a rung's knob (its ``ablation.knob``, else its name) -> (the knob, the capability it needs of the model):
#: the ladder rung that adds it and the leave-one-out that drops it both mean nothing without it
RUNG_NEEDS = {"chunked_loss": ("loss=chunked", "head"), "sdpa": ("attention=sdpa", "attention"),
              "fp8": ("precision=fp8", "linear"), "checkpointing=full": ("checkpointing=full", "blocks"),
              "checkpointing=selective": ("checkpointing=selective", "blocks")}
#: a knob a rung inherits but the model cannot take -> (the config piece, its new values, the override that says so)
TURN_OFF = {"loss": ("loss", {"name": "standard"}, "loss=standard"),
            "checkpointing": ("checkpointing", {"name": "none", "every_k": 0}, "checkpointing=none"),
            "compile_options.scope": ("compile_options", {"scope": "model"}, "compile_options.scope=model")}


@dataclass
class Decision:
    """A rung's fate on this device and model: skipped (with why), or run with ``turned_off``."""

    config: TrainConfig  # the job's configuration, with what the model cannot take turned off
    skip: str | None = None
    turned_off: list[str] = field(default_factory=list)  # overrides, e.g. "loss=standard"


def decide(cfg: TrainConfig) -> Decision:
    """Skip the rung, or the overrides that turn off what the model cannot take from below."""
    try:
        on_device = rung_applies(cfg.ablation.acts_on, cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not on_device:
        return Decision(cfg, skip=f"not applicable on {device_kind(cfg.device)}: {cfg.ablation.why}")
    if beyond_tradeoff_repeats(cfg.ablation, cfg.repeat):
        n = cfg.ablation.tradeoff_repeats
        return Decision(cfg, skip=f"measured in its first {n} repeat(s) only (ablation.tradeoff_repeats={n}): a memory "
                                  "trade-off's memory is the same in every repeat, and the verdict does not read its speed")
    from perfrun.models.build import shape_only
    from perfrun.models.contract import knob_fits, missing

    model = shape_only(cfg.model, int(cfg.data.vocab_size or 50257), str(cfg.attention))
    own = RUNG_NEEDS.get(cfg.ablation.knob or cfg.ablation.rung)
    why = missing(model, own[1], own[0]) if own else None
    if why is not None:
        return Decision(cfg, skip=f"not applicable to model {cfg.model.name}: {why}")
    decision = Decision(cfg)
    for fit in (f for f in knob_fits(model, cfg) if not f.applies):
        if fit.refused and fit.key in TURN_OFF:
            piece, values, override = TURN_OFF[fit.key]
            changed = dataclasses.replace(getattr(decision.config, piece), **values)
            decision.config = dataclasses.replace(decision.config, **{piece: changed})
            decision.turned_off.append(override)
            log.info(f"rung {cfg.ablation.rung}: {override} here ({fit.reason})")
    return decision


def beyond_tradeoff_repeats(ablation: AblationConfig | DictConfig, repeat: int) -> bool:
    """A memory trade-off rung (checkpointing, accumulation, the largest batch) past its
    repeats: what it measures is memory, the same in every repeat; its speed, measured in
    the repeats it runs, is reported apart and never read by the verdict."""
    return str(ablation.kind) == "tradeoff" and int(repeat) >= int(ablation.tradeoff_repeats)


def skip(cfg: TrainConfig, run_dir: Path | None, overrides: list[str], reason: str) -> RunSummary:
    """The rung's ``skipped`` summary; one already in ``run_dir`` stays, unless it is this
    job's own refusal (a ``failed`` summary with the same reason)."""
    summary: RunSummary = {"status": "skipped", "reason": reason, "overrides": list(overrides),
                           "config": as_dict(cfg)}
    log.info(f"rung {cfg.ablation.rung} skipped, {reason}")
    if run_dir is not None:
        path = run_dir / "summary.json"
        there = read_summary(run_dir) if path.exists() else None
        if there is None or (there.get("status") == "failed" and reason.endswith(str(there.get("reason")))):
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json(path, summary)
    return summary


def run_rung(cfg: TrainConfig, run_dir: Path | None, *, overrides: list[str], search: RunSearch | None = None,
             sweep_args: Sequence[str] = (), decision: Decision | None = None,
             found: FoundBatches | None = None) -> RunSummary:
    """One rung's job in this process: skipped, or trained with what the model cannot take off
    (``decision``: :func:`decide`'s answer for ``cfg`` where the caller has it already)."""
    from perfrun.distributed import rank
    from perfrun.knobs import KnobRefused
    from perfrun.loop.run import run

    decision = decision if decision is not None else decide(cfg)
    mine = run_dir if rank() == 0 else None
    if decision.skip is not None:
        return skip(cfg, mine, overrides, decision.skip)
    try:
        return run(decision.config, run_dir, overrides=[*overrides, *decision.turned_off], search=search,
                   sweep_args=sweep_args, found=found)
    except KnobRefused as e:
        return skip(cfg, mine, overrides, f"not applicable to model {cfg.model.name}: {e.reason}")
