"""The optimizer step in the backward (``optim.in_backward=true``): each parameter is stepped
in its post-accumulate-grad hook and its gradient freed at once, so the gradients of the whole
model never exist together (torch's ``Tensor.register_post_accumulate_grad_hook``).

The run's one optimizer does the stepping: when a parameter's hook runs, it is the only
parameter holding a gradient (those before it were stepped and freed, those after it have none
yet), so ``optimizer.step()`` steps it alone, its state and the schedule's rate are the
optimizer's own, and a checkpoint saves and loads that optimizer as any run's.

What needs every gradient before the first step is refused: a global-norm clip (the norm is
known only when the last gradient is), accumulation (each micro-batch would step), fp16's
loss scaling (its inf/NaN check spans all gradients), and DDP/FSDP (their gradient
reductions, not measured correct with the hooks yet). The gradient norm is still reported:
each hook adds its gradient's square norm.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from perfrun.config import ConfigError, TrainConfig


def check(cfg: TrainConfig) -> None:
    """One line for what cannot step in the backward, before anything is built."""
    if not cfg.optim.in_backward:
        return
    why = None
    if cfg.optim.grad_clip > 0:
        why = (f"a global-norm clip (optim.grad_clip={cfg.optim.grad_clip}) needs every gradient before the first "
               "step; set optim.grad_clip=0")
    elif cfg.accumulation.steps > 1:
        why = (f"accumulation.steps={cfg.accumulation.steps} would step on every micro-batch; "
               "set accumulation.steps=1 (a larger dataloader.batch_size keeps the global batch)")
    elif cfg.precision.dtype == "float16":
        why = "fp16's loss scaling checks every gradient for inf/NaN before any step; use precision=bf16"
    elif cfg.distributed != "none":
        why = f"with distributed={cfg.distributed} it is not measured correct yet; use distributed=none"
    elif cfg.offload.name == "optimizer":
        why = "offload=optimizer steps on the host after the backward; choose one of the two"
    if why:
        raise ConfigError(f"optim.in_backward=true: {why}")


class StepInBackward:
    """The hooks that step each parameter as its gradient is accumulated, and the gradient
    norm they saw, handed to the step as the plan's optimizer step."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.optimizer: torch.optim.Optimizer | None = None
        self._square: torch.Tensor | None = None

    def attach(self, optimizer: torch.optim.Optimizer, stack: ExitStack) -> None:
        """Hook every parameter to ``optimizer``; the hooks are removed when the job ends."""
        self.optimizer = optimizer
        handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.params]
        stack.callback(lambda: [h.remove() for h in handles])

    def _step(self, param: torch.Tensor) -> None:
        assert self.optimizer is not None and param.grad is not None
        square = torch.linalg.vector_norm(param.grad, dtype=torch.float32).square()
        self._square = square if self._square is None else self._square + square
        self.optimizer.step()  # only ``param`` holds a gradient now
        param.grad = None

    def __call__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], clip: float) -> torch.Tensor:
        """The step's work was done in the backward: the gradient norm of the step."""
        square, self._square = self._square, None
        return torch.zeros(()) if square is None else square.sqrt()


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    if not cfg.optim.in_backward:
        return
    check(cfg)
    stepper = StepInBackward([p for p in plan.raw_model.parameters() if p.requires_grad])
    plan.optimizer_hooks.append(lambda optimizer: stepper.attach(optimizer, stack))
    plan.stepper = stepper
    plan.notes["optim_in_backward"] = True
