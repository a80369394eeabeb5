"""Everything before the first step: the validated config, the device, the data, the model,
the knobs (the plan), the optimizer and its schedule, the loaders and the MFU peak. Setup
reads the configuration and never writes into it: what it finds out is a :class:`Resolved`."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from perfrun import distributed
from perfrun.config import TrainConfig, as_dict
from perfrun.data import build_datasets, build_loader
from perfrun.data.custom import check_token_ids
from perfrun.environment import device_name
from perfrun.knobs import Plan, apply_knobs, refuse_unmet
from perfrun.loop.refusals import refuse_before_building
from perfrun.loop.runtime import fixed_heap
from perfrun.loop.step import TrainStep, Untimed
from perfrun.memory.found_batches import FoundBatches
from perfrun.memory.preflight import train_preflight
from perfrun.models.build import build_model
from perfrun.models.contract import describe, knob_fits, model_class, parameter_counts
from perfrun.models.custom import check_forward, check_vocab
from perfrun.models.flops import flops_figure
from perfrun.models.hf import describe as hf_describe
from perfrun.optim.adamw import build_optimizer, build_scheduler
from perfrun.summary import RunSummary
from perfrun.telemetry.mfu import mfu_dtype, resolve_peak
from perfrun.telemetry.profiling import start_memory_history
from perfrun.telemetry.step_metrics import Throughput
from perfrun.validate import validate

log = logging.getLogger("perfrun")


@dataclass
class Resolved:
    """What setup found out, beside the configuration the user composed: the device, the
    batch size (``dataloader.batch_size=auto``'s choice, else the one given), the tokenizer
    and vocabulary the data has, the vocabulary the model pads it to, the knobs that applied.
    Filled in as setup goes (None: not reached); summary.json writes it (``resolved``, and
    ``knobs``), and :meth:`config_record` is the configuration a run records."""

    device: str | None = None
    batch_size: int | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None  # the data's; None until the data is built
    vocab_size_padded: int | None = None
    knobs: dict[str, Any] = field(default_factory=dict)

    def config_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """The configuration as summary.json and checkpoints record it: as composed, with the
        data's tokenizer and vocabulary and the batch size in place (perfrun generate reads
        ``data.tokenizer`` there, and a resume compares the batch)."""
        record = as_dict(cfg)
        if self.vocab_size is not None:
            record["data"].update(tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        if self.batch_size is not None:
            record["dataloader"]["batch_size"] = self.batch_size
        return record

    def summary(self) -> dict[str, Any]:
        """summary.json's ``resolved`` entry (the knobs have their own, ``knobs``)."""
        return {"device": self.device, "batch_size": self.batch_size, "tokenizer": self.tokenizer,
                "vocab_size": self.vocab_size, "vocab_size_padded": self.vocab_size_padded}


@dataclass
class Setup:
    """What setup built: the device, the plan the knobs made, the optimizer and the data."""

    device: torch.device
    plan: Plan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    throughput: Throughput
    facts: RunSummary  # the model, data, knobs and MFU peak, for summary.json
    resolved: Resolved


def setup(cfg: TrainConfig, stack: ExitStack, resolved: Resolved, found: FoundBatches | None = None,
          job: str = "") -> Setup:
    """Everything before the first step: validated config, data, model, knobs, optimizer;
    what it finds out goes into ``resolved`` (the caller's, so a failed setup still tells);
    ``found``: the batch searches of earlier jobs of a sweep, which ``job`` may reuse."""
    validate(cfg)
    device = distributed.setup_device(cfg.device, cfg.distributed, stack)
    resolved.device = str(device)
    refuse_before_building(cfg, device)
    runtime = stack.enter_context(fixed_heap(cfg.runtime, device.type))  # before the first tensor of the run
    rank, world = distributed.rank(), distributed.world_size()
    snapshot = start_memory_history(cfg, device, stack)
    distributed.seed_everything(cfg.seed)
    seq_len = cfg.data.seq_len or cfg.model.block_size
    data = build_datasets(cfg.data, seq_len, cfg.seed)
    resolved.tokenizer, resolved.vocab_size = data.tokenizer, data.vocab_size  # what the ids are, recorded with the run
    log.info(data.description)
    if cfg.data.name == "custom" and cfg.model.family != "custom":  # perfrun's models embed token ids
        check_token_ids(data, str(cfg.data.target))
    memory_estimate = train_preflight(cfg, data.vocab_size, device, world) if rank == 0 else None

    m = cfg.model
    model = build_model(m, data.vocab_size, cfg.attention)
    resolved.vocab_size_padded = getattr(getattr(model, "config", None), "vocab_size", data.vocab_size)
    if m.family == "hf":  # the architecture and shape the folder gave, and where its weights came from
        log.info(hf_describe(model))
    example = data.train[0]
    if m.family == "custom":  # the data's ids must fit its vocabulary; its forward must give (logits or None, loss)
        check_vocab(model, str(m.target), data.vocab_size, cfg.data.name)
        check_forward(model, *example, f"{m.name} ({m.target})")
    fits = knob_fits(model, cfg)
    for line in describe(fits):
        log.info(line)
    refuse_unmet(fits)  # before the model moves or any knob acts
    flops = flops_figure(model, example, seq_len)
    log.info(flops.describe())
    model = model.to(device)
    plan = apply_knobs(cfg, device, model, stack)
    resolved.knobs = plan.notes
    optimizer, fused = build_optimizer(model, cfg.optim, device, offload=cfg.offload.name == "optimizer",
                                       distributed=cfg.distributed)
    plan.attach(optimizer)
    if world > 1:
        distributed.seed_rank(cfg.seed, rank)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    auto_batch = None
    if cfg.dataloader.batch_size == "auto":  # the largest batch that fits, found before the loaders exist
        from perfrun.memory.batch_size import line_start, resolve_auto_batch

        def search() -> dict[str, Any]:
            return resolve_auto_batch(cfg.dataloader, device, plan, optimizer, scheduler, len(data.train), example,
                                      step_of=lambda one, batches: TrainStep(one, optimizer, scheduler, batches,
                                                                             Untimed(), clip=cfg.optim.grad_clip,
                                                                             device=device),
                                      start=lambda limit, cap: line_start(cfg, data.vocab_size, limit, cap))

        auto_batch = (found.reuse_or_search(FoundBatches.key(as_dict(cfg), device), search, job) if found is not None
                      else search())
        resolved.batch_size = int(auto_batch["batch_size"])
    else:
        resolved.batch_size = int(cfg.dataloader.batch_size)
    batch_size = resolved.batch_size
    dl = replace(cfg.dataloader, batch_size=batch_size)
    train_loader = build_loader(data.train, dl, device_type=device.type, shuffle=True, seed=cfg.seed,
                                rank=rank, world=world)
    val_loader = build_loader(data.val, dl, device_type=device.type, shuffle=False, seed=cfg.seed,
                              rank=rank, world=world)

    peak = resolve_peak(str(cfg.mfu.peak), device, mfu_dtype(cfg.precision.dtype, device, cfg.precision.tf32))
    tokens_per_step = batch_size * seq_len * plan.micro_steps * world  # all ranks together
    throughput = Throughput(tokens_per_step, flops.per_token, peak.tflops if flops.per_token else None,
                            peak.source if flops.per_token else "no FLOPs per token (see the FLOPs line)", world)
    facts: RunSummary = {
        "knobs": plan.notes, "fused_adamw": fused, **parameter_counts(model), "model_class": model_class(model),
        "knob_fits": [f.as_dict() for f in fits],
        "vocab_size": data.vocab_size, "vocab_size_padded": resolved.vocab_size_padded,
        "seq_len": seq_len, "tokens_per_step": tokens_per_step, **flops.facts(), **peak.facts(),
        "data": data.description, "batch_size_auto": auto_batch, "memory_snapshot": snapshot,
        "memory_estimate": memory_estimate, "runtime": runtime,
    }
    log.info(
        f"model {m.name}: {facts['params'] / 1e6:.2f}M parameters, seq_len {seq_len}, "
        f"{tokens_per_step:,} tokens/step, device {device} ({device_name(device)})"
        + (f", {world} ranks ({cfg.distributed.upper()}, {batch_size * world} sequences per micro-step in all)"
           if world > 1 else "")
    )
    log.info(peak.describe())
    return Setup(device, plan, optimizer, scheduler, train_loader, val_loader, throughput, facts, resolved)
