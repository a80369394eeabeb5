"""``perfrun estimate [overrides]``: the memory a training configuration will need, before
anything runs (:mod:`perfrun.memory.estimate`: the run's model, knobs, optimizer, loss and
batch under fake tensors, the optimizer's state made, one step under torch's memory tracker,
nothing allocated).

A Hydra app over the trainer's configuration (conf/estimate.yaml lists train first, so
every ``perfrun train`` override works here) with its own keys under ``estimate``. It
prints the expected peak by category and module, whether it fits ``memory.size`` (default
the visible GPU's memory), the largest batch that fits, and for a configuration that does
not fit, which knob would make it fit and by how much. Everything printed is an estimate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from perfrun.checkpoint.atomic import atomic_write, check_out_file
from perfrun.commands.hydra_app import HydraCommand
from perfrun.config import ConfigError, TrainConfig
from perfrun.console import error
from perfrun.validate import check_distributed, validate

CAP = 4096  # the largest batch the search tries


@dataclass
class EstimateOptions:
    """``perfrun estimate``'s own keys (``estimate.KEY=VALUE``)."""

    json: bool = field(default=False, metadata={"help": "print the estimate as one JSON document on stdout"})
    top: int = field(default=10, metadata={"help": "modules listed, those holding most first"})
    fit: bool = field(default=True, metadata={"help": "find the largest batch that fits and, when it does not "
                                                      "fit, the knob that would (more estimates)"})
    out: str | None = field(default=None, metadata={"help": "also write the JSON document to this file"})
    ladder: str | None = field(default=None, metadata={"help": "a ladder's sweep folder: each memory knob's measured "
                                                              "speed beside its estimated peak"})

    def check(self) -> None:
        """Before any work: a negative ``top``, or an ``out`` that cannot be written (a folder,
        under a missing folder, a read-only file), is refused in one line."""
        if self.top < 0:
            raise ConfigError(f"estimate.top={self.top} must be >= 0 (the number of modules listed); e.g. estimate.top=10")
        if self.out:
            check_out_file(Path(self.out).expanduser(), "estimate.out", "estimate.json")


@dataclass
class EstimateJobConfig(TrainConfig):
    """The trainer's configuration and the estimate's own keys."""

    estimate: EstimateOptions = field(default_factory=EstimateOptions)


class EstimateCommand(HydraCommand):
    def register(self) -> None:
        """Train's keys come from conf/train.yaml as train composes them; the schema types
        only ``estimate`` (train's fields left MISSING keep what train chose, as tune does)."""
        from hydra.core.config_store import ConfigStore
        from omegaconf import MISSING, OmegaConf

        from perfrun.commands.hydra_app import keys_help
        from perfrun.config import register_configs

        register_configs()
        store = ConfigStore.instance()
        if "estimate_schema.yaml" not in store.repo:  # once per process, as register_tune_schema
            node = OmegaConf.structured(EstimateJobConfig)
            for f in fields(TrainConfig):
                node[f.name] = MISSING
            store.store(name="estimate_schema", node=node)
        text = keys_help(EstimateOptions)
        OmegaConf.register_new_resolver("perfrun_keys", lambda: text, replace=True)


def run(cfg: EstimateJobConfig) -> int:
    """The estimate of ``cfg``: 0 printed (fitting or not), 1 when it cannot be made, 2 for a config error."""
    from perfrun.memory.estimate import EstimateError

    try:
        cfg.estimate.check()
        validate(replace(cfg, nproc=1))  # nproc ranks are estimated here, not started (no torchrun to check)
        check_distributed(cfg, world=max(1, cfg.nproc))  # train's rules for distributed and nproc, as if started
        document, lines = _estimate(cfg)
    except ConfigError as e:
        error(str(e))
        return 2
    except EstimateError as e:
        error(str(e))
        return 1
    text = json.dumps(document, indent=2)
    if cfg.estimate.out:
        out = Path(cfg.estimate.out).expanduser()
        try:
            atomic_write(out, text + "\n")
        except OSError as e:
            error(f"estimate.out={cfg.estimate.out} could not be written ({e.strerror or e}); "
                  "choose a writable estimate.out")
            return 2
    print(text if cfg.estimate.json else "\n".join(lines), file=sys.stdout)
    return 0


def vocab_of(cfg: TrainConfig) -> int:
    """The run's vocabulary, as setup finds it (the data source says it)."""
    from perfrun.data import build_datasets

    return int(build_datasets(cfg.data, int(cfg.data.seq_len or cfg.model.block_size), cfg.seed).vocab_size)


def _estimate(cfg: EstimateJobConfig) -> tuple[dict[str, Any], list[str]]:
    from perfrun.memory.batch_size import largest_batch
    from perfrun.memory.describe import describe, fit_line
    from perfrun.memory.estimate import estimate
    from perfrun.memory.fit import advice, ladder_speeds, memory_limit, ranked, what_fits
    from perfrun.models.pretrained import with_folder_shape

    cfg = with_folder_shape(cfg)  # model=llama model.init_from=FOLDER: the folder's shape
    if cfg.dataloader.batch_size == "auto":
        raise ConfigError("dataloader.batch_size=auto: the estimate needs a batch size; give one "
                          "(the estimate then says the largest that fits)")
    limit, where = memory_limit(cfg.memory.size)  # a memory.size that is no size is refused before any work
    speeds = ladder_speeds(cfg.estimate.ladder) if cfg.estimate.ladder else None
    vocab = vocab_of(cfg)
    e = estimate(cfg, vocab, top=cfg.estimate.top)
    lines = describe(cfg, e)
    doc: dict[str, Any] = {**e.to_dict(), "config": _knobs(cfg), "memory_limit_bytes": limit, "memory_limit_source": where}
    largest = None
    if limit is not None and cfg.estimate.fit:
        largest = largest_batch(lambda b: estimate(cfg, vocab, batch_size=b, top=0).peak_bytes, limit, cap=CAP)
        doc["largest_batch"] = {"batch_size": largest[0], "estimates": largest[1], "cap": CAP}
    lines.append(fit_line(e, limit, where, largest, CAP))
    if limit is not None:
        doc["fits"] = e.peak_bytes <= limit
        if cfg.estimate.fit:  # every memory knob, ranked by the peak it gives
            fixes = what_fits(cfg, vocab, limit, costs=speeds)
            doc["knobs"] = [vars(f) for f in fixes]
            if e.peak_bytes > limit:
                lines.append("  " + advice(e, limit, where, fixes))
            lines.append("  each memory knob alone, by its estimated peak" + (" (speed: the ladder's)" if speeds else
                                                                          " (give estimate.ladder=DIR for speeds)"))
            lines += ranked(fixes)
    return doc, lines


def _knobs(cfg: TrainConfig) -> dict[str, Any]:
    return {"model": cfg.model.name, "batch_size": cfg.dataloader.batch_size, "accumulation": cfg.accumulation.steps,
            "precision": cfg.precision.name, "checkpointing": cfg.checkpointing.name, "loss": cfg.loss.name,
            "compile": cfg.compile, "distributed": cfg.distributed, "nproc": cfg.nproc}


COMMAND = EstimateCommand("estimate", EstimateJobConfig, run)


def main(argv: list[str]) -> int:
    """``perfrun estimate KEY=VALUE...``: 0 estimated, 1 it cannot be, 2 a user's mistake."""
    return COMMAND.main(argv)
