"""AdamW with decay on 2-D weights only, and a linear warm-up then cosine schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from perfrun.config import ConfigError, OptimConfig
from perfrun.optim.low_bit import LOW_BIT, build_low_bit, check


def build_optimizer(model: nn.Module, cfg_optim: OptimConfig, device: torch.device, *,
                    offload: bool = False, distributed: str = "none") -> tuple[torch.optim.Optimizer, bool]:
    """Return the optimizer (``optim.name``: fp32, 8- or 4-bit moments; ``offload``: its state
    and step on the host, perfrun/knobs/offload.py) and whether it uses the fused kernel.
    A low-bit optimizer the run cannot take is refused here, before any step.

    Matrices (linear weights, embeddings) decay; biases and LayerNorm gains do not.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg_optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    check(cfg_optim, distributed)
    if cfg_optim.name in LOW_BIT:
        if offload:
            raise ConfigError(f"offload=optimizer with optim={cfg_optim.name}: the host keeps fp32 moments cheaply; "
                              "choose one of the two (optim=adamw offload=optimizer)")
        return build_low_bit(groups, cfg_optim), False
    if offload:  # torchao's CPUOffloadOptimizer: the state on the host, stepped there by fused AdamW
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(groups, torch.optim.AdamW, lr=cfg_optim.lr, betas=(cfg_optim.beta1, cfg_optim.beta2),
                                   eps=cfg_optim.eps, fused=True), True
    fused_supported = device.type in ("cuda", "cpu")
    if cfg_optim.fused == "auto":
        fused = fused_supported
    else:
        fused = cfg_optim.fused == "true"
        if fused and not fused_supported:
            raise ConfigError(f"optim.fused=true: no fused AdamW on {device.type}; set optim.fused=auto")
    opt = torch.optim.AdamW(
        groups, lr=cfg_optim.lr, betas=(cfg_optim.beta1, cfg_optim.beta2), eps=cfg_optim.eps,
        fused=fused or None,
    )
    return opt, fused


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The learning rate's multiplier at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg_optim: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg_optim.warmup_steps, max_steps, cfg_optim.min_lr_ratio)
    )
