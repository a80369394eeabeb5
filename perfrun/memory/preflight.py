"""The estimate where it is cheap: the train log's first lines (with a warning before step
1 when the configuration will not fit a GPU, naming the knob that would make it fit, and a
refusal when it will not fit the CPU's memory) and gpu-check's line for the GPT-2 124M shape
against the device's memory. Estimates, said so.

On the CPU the estimate is made when ``memory.size`` is given, or when two bounds below what
a step takes (the training state at 16 bytes a parameter, counted on the meta device, and the
logits with their gradient) reach half the memory there is: a run that may not fit is
estimated, a small one costs nothing. A run that will not fit is refused there, not warned:
a process that outgrows the machine's memory is killed by the kernel with no word and no
summary, where a GPU's out-of-memory error is caught and explained."""

from __future__ import annotations

import logging
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig
from perfrun.memory.breakdown import one_line
from perfrun.memory.estimate import EstimateError, estimate, variant
from perfrun.memory.fit import advice, gib, parse_size, what_fits

log = logging.getLogger("perfrun")


def device_limit(size: str | None, device: torch.device) -> tuple[int | None, str]:
    """``memory.size`` if given, else this CUDA device's memory, or on the CPU the memory
    this machine has available now (what the run can take without the kernel ending it)."""
    if size is not None:
        return parse_size(size), f"memory.size={size}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name}'s memory"
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available), "this machine's available memory"
    return None, f"{device.type} (no memory size to fit)"


STATE_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments


def may_not_fit(cfg: TrainConfig, vocab_size: int, limit: int | None) -> bool:
    """Whether a CPU run is large enough against ``limit`` to be estimated by default: its
    training state (:data:`STATE_BYTES_PER_PARAMETER` a parameter, the model built on the meta
    device: no memory, no initialisation) and its fp32 logits with their gradient reach half
    of it. A user's model is built only by the run (its constructor is the user's code): it is
    estimated when asked, with memory.estimate=true or memory.size."""
    from perfrun.models.build import shape_only
    from perfrun.models.gpt import padded_vocab

    if limit is None or cfg.model.family == "custom" or cfg.dataloader.batch_size == "auto":
        return False
    params = sum(p.numel() for p in shape_only(cfg.model, vocab_size, cfg.attention).parameters())
    seq_len = int(cfg.data.seq_len or cfg.model.block_size)
    logits = int(cfg.dataloader.batch_size) * seq_len * padded_vocab(vocab_size) * 8
    return params * STATE_BYTES_PER_PARAMETER + logits >= limit // 2


def wanted(cfg: TrainConfig, device: torch.device, world: int) -> str | None:
    """None when the train log should carry the estimate, else why not."""
    if cfg.memory.estimate is False:
        return "memory.estimate=false"
    if cfg.memory.estimate is None and device.type not in ("cuda", "cpu"):
        return f"off on {device.type} by default (memory.estimate=true turns it on)"
    if world > 1:
        return "a run over several processes (estimate it first: perfrun estimate distributed=... nproc=N)"
    if cfg.dataloader.batch_size == "auto":
        return "dataloader.batch_size=auto (the search says what fits)"
    return None


def train_preflight(cfg: TrainConfig, vocab_size: int, device: torch.device, world: int) -> dict[str, Any] | None:
    """The estimate's line in the train log, and a warning when it will not fit a GPU, or a
    ConfigError when it will not fit the CPU's memory; the estimate for summary.json
    (``memory_estimate``), None when not made. A ``memory.size`` that is not a size is
    refused here, before any work, whether or not an estimate is made."""
    if cfg.memory.size is not None:
        parse_size(str(cfg.memory.size))
    if wanted(cfg, device, world) is not None:
        return None
    limit, where = device_limit(cfg.memory.size, device)
    if (cfg.memory.estimate is None and device.type == "cpu" and cfg.memory.size is None
            and not may_not_fit(cfg, vocab_size, limit)):
        return None
    try:
        e = estimate(cfg, vocab_size, top=3)
    except EstimateError as err:
        log.warning(f"memory estimate: {err}")
        return {"kind": "estimate", "error": str(err)}
    log.info(one_line("memory ESTIMATE (not measured):", e.breakdown.categories, e.peak_bytes)
             + (f" of {gib(limit)}" if limit else ""))
    doc = {**e.to_dict(), "memory_limit_bytes": limit, "memory_limit_source": where}
    if limit is not None:
        doc["fits"] = e.peak_bytes <= limit
        if not doc["fits"] and device.type == "cpu":
            raise ConfigError(
                f"model={cfg.model.name} at dataloader.batch_size={cfg.dataloader.batch_size} will not fit: its memory "
                f"ESTIMATE is {gib(e.peak_bytes)} against {gib(limit)} ({where}), and a process that outgrows it is "
                "killed with no word; use a smaller model, batch or data.seq_len (perfrun estimate with the same "
                f"overrides and memory.size={cfg.memory.size or f'{limit // 2**20}MiB'} names the knob that fits), or "
                "memory.estimate=false to start anyway")
        if not doc["fits"]:
            fixes = what_fits(cfg, vocab_size, limit, first=True)
            doc["advice"] = advice(e, limit, where, fixes)
            log.warning(f"this configuration will not fit: {doc['advice']}")
    return doc


GPT2_SHAPE = {"model.name": "gpt2", "model.n_layer": 12, "model.n_head": 12, "model.n_embd": 768,
              "model.block_size": 1024, "dataloader.batch_size": 16, "data.seq_len": None}


def gpu_check_estimate(device: torch.device, bf16: bool) -> dict[str, Any]:
    """gpu-check's fact: the GPT-2 124M shape at batch 16 x 1024 (bf16 where the device
    has it) estimated against this device's memory."""
    from perfrun.config import TrainConfig

    precision = {"precision.name": "bf16", "precision.dtype": "bfloat16"} if bf16 else {}
    cfg = variant(TrainConfig(), **GPT2_SHAPE, **precision, device=str(device))
    limit, where = device_limit(None, device)
    try:
        e = estimate(cfg, 50257, top=0)
    except EstimateError as err:
        return {"error": str(err)}
    out = {"config": "model=gpt2 dataloader.batch_size=16" + (" precision=bf16" if bf16 else ""),
           "estimated_peak_bytes": e.peak_bytes, "memory_bytes": limit, "memory_source": where, "measured": False,
           "not_counted": e.not_counted}
    if limit is not None:
        out["fits"] = e.peak_bytes <= limit
        if not out["fits"]:
            out["advice"] = advice(e, limit, where, what_fits(cfg, 50257, limit, first=True))
    return out


def gpu_check_line(fact: dict[str, Any]) -> str:
    if "error" in fact:
        return f"memory estimate: {fact['error']}"
    limit = fact.get("memory_bytes")
    verdict = "" if limit is None else (" fits" if fact["fits"] else f" does NOT fit: {fact['advice']}")
    return (f"memory ESTIMATE for {fact['config']}: peak {gib(fact['estimated_peak_bytes'])}"
            + (f" of {gib(limit)}" if limit else "") + verdict)
