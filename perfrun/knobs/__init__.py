"""Performance knobs. Each is applied once, at setup, and undoes itself on exit.

A knob module exposes ``apply(cfg, device, plan, stack)``: it changes the plan (wraps
the model, adds a context entered around each forward, enables the gradient scaler) and
registers on ``stack`` whatever restores global state, so that the next job of a sweep
in the same process starts as if it were the first. The loop only sees the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from perfrun import distributed
from perfrun.config import TrainConfig
from perfrun.knobs.refusal import KnobRefused, need, refuse_unmet
from perfrun.models import contract

__all__ = ["KnobRefused", "Plan", "apply_knobs", "check_knobs", "need", "refuse_unmet"]


def _no_scaling() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=False)


@dataclass
class Plan:
    """What the knobs hand the training loop."""

    model: nn.Module  # the module the loop calls: maybe checkpointed, maybe compiled
    raw_model: nn.Module  # the plain model: parameters, state_dict, eval
    micro_steps: int = 1
    # fp16's loss scaling; a disabled GradScaler is a pass-through (nanoGPT's way), so no caller branches on it
    scaler: torch.amp.GradScaler = field(default_factory=_no_scaling)
    contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)
    step_hooks: list[Callable[[int], None]] = field(default_factory=list)  # called after each step (profiler)
    step_start_hooks: list[Callable[[int], None]] = field(default_factory=list)  # before each step (CUDA graphs)
    notes: dict[str, Any] = field(default_factory=dict)  # what each knob did, for summary.json
    sharded_state: bool = False  # FSDP: every rank saves and loads its own shards
    # Entered around forward and backward of micro-step i of n (DDP, FSDP: no gradient sync but on the last).
    micro_step_context: Callable[[int, int], AbstractContextManager[Any]] = lambda i, n: nullcontext()
    # given the optimizer once it is built (the optimizer step in the backward hooks the parameters to it)
    optimizer_hooks: list[Callable[[torch.optim.Optimizer], None]] = field(default_factory=list)
    # the step's optimizer step, when a knob does it otherwise (in the backward): (optimizer, params, clip) -> norm
    stepper: Callable[[torch.optim.Optimizer, list[torch.Tensor], float], torch.Tensor] | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the run's optimizer to the knobs that act on it."""
        for hook in self.optimizer_hooks:
            hook(optimizer)

    def forward_context(self) -> ExitStack:
        """Enter every knob's context (autocast, SDPA backend) for one forward pass."""
        stack = ExitStack()
        for make in self.contexts:
            stack.enter_context(make())
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (fp16: scaled) loss."""
        self.scaler.scale(loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                       clip: float) -> torch.Tensor:
        """Unscale (fp16), clip to ``clip``, step (fp16: skipped on inf/NaN gradients) and
        update the scale. Returns the gradient norm before clipping, as a plain tensor."""
        if self.stepper is not None:
            return self.stepper(optimizer, params, clip)
        self.scaler.unscale_(optimizer)
        grad_norm = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(params, clip))  # FSDP: a DTensor
        self.scaler.step(optimizer)
        self.scaler.update()
        return grad_norm

    @property
    def skips_nonfinite_steps(self) -> bool:
        """fp16: the scaler skips a step whose gradients are not finite."""
        return self.scaler.is_enabled()

    def loss_scale(self) -> float | None:
        """fp16's current scale, for the train record (a sync: read it at log points only)."""
        return self.scaler.get_scale() if self.scaler.is_enabled() else None

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the knobs' state: fp16's loss scaling (None without fp16),
        for exact resume."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        """Take a checkpoint's loss scale back; nothing to do without fp16."""
        if self.scaler.is_enabled() and state_dict:
            self.scaler.load_state_dict(state_dict)


def check_knobs(cfg: TrainConfig, device: torch.device) -> None:
    """Every knob's refusal that needs only the configuration and the device (not the data,
    not the model): FSDP's options, FP8, TF32 and autocast, the SDPA backend, offloading, the
    optimizer step in the backward. Raises ConfigError; each knob's apply checks again."""
    from perfrun.knobs import backends, fp8, fsdp, offload, optim_in_backward, precision

    fsdp.check(cfg)
    fp8.check(cfg, device)
    precision.check(cfg, device)
    backends.check(cfg, device)
    offload.check(cfg, device)
    optim_in_backward.check(cfg)


def apply_knobs(cfg: TrainConfig, device: torch.device, model: nn.Module, stack: ExitStack) -> Plan:
    """Apply every knob in a fixed order: backends, precision, fp8 (on the plain model), the
    loss, activation checkpointing, offload, the optimizer step in the backward, ddp or fsdp,
    compile. A knob the model cannot take is
    refused (KnobRefused) before any is applied."""
    from perfrun.knobs import (
        activation_checkpointing,
        backends,
        compilation,
        ddp,
        fp8,
        fsdp,
        loss,
        offload,
        optim_in_backward,
        precision,
    )

    refuse_unmet(contract.knob_fits(model, cfg))
    plan = Plan(model=model, raw_model=model, micro_steps=int(cfg.accumulation.steps))
    plan.notes["accumulation_steps"] = plan.micro_steps
    for knob in (backends, precision, fp8, loss, activation_checkpointing, offload, optim_in_backward, ddp, fsdp,
                 compilation):
        knob.apply(cfg, device, plan, stack)
    return plan
