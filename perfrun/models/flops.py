"""FLOPs per token measured for any model: torch's FlopCounterMode over one forward and
backward, run under FakeTensorMode so that no arithmetic happens and no memory is taken.
One of perfrun's own models small enough on the CPU (about a GFLOP a pass) is counted on
real copies of its tensors instead: the same count, sooner, because a small model's real
arithmetic costs less than dispatching its ops through fake tensors
(docs/measurements.md: counting FLOPs).

The model's own parameters are not touched: the pass goes through ``functional_call`` with
copies of them (fake, or real clones), and the gradients are taken with ``autograd.grad``.
The copies sit on the model's device, so the same kernels are chosen as in training; the
CPU's flash kernel of ``scaled_dot_product_attention`` has no count in torch (2.13), so one
is registered here (torch's count for the CUDA flash kernel) and the figure does not depend
on the device. Like the analytic formula it is model FLOPs: recomputation is not counted,
neither activation checkpointing's nor the one torch counts in every fused attention
backward (the scores again: 5 matmuls where the model has 4).
"""

from __future__ import annotations

from dataclasses import dataclass, is_dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # fake tensors: no public module
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from perfrun.console import first_line
from perfrun.models import contract
from perfrun.summary import RunSummary

_aten = torch.ops.aten


def _cpu_flash_forward(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                        out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _model_flops_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                          out_shape: Any = None, **kwargs: Any) -> int:
    """A fused attention backward without its recomputation of the scores: the model's own
    four matmuls, twice the forward's two (as the 12*L*H*Q*T of the formula has it)."""
    b, h, s_q, d = query_shape
    s_k = key_shape[2]
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) - 2 * b * h * s_q * d * s_k


#: every fused attention backward in torch's flop registry, counted without its recompute
_BACKWARDS = ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward")


def _model_flops_mapping() -> dict[Any, Any]:
    return {getattr(_aten, name): _model_flops_backward for name in _BACKWARDS if hasattr(_aten, name)}


def register_cpu_attention() -> None:
    """Count the CPU flash-attention kernel and its backward (once per process)."""
    from torch.utils.flop_counter import flop_registry

    forward = _aten._scaled_dot_product_flash_attention_for_cpu
    if forward in flop_registry or forward.default in flop_registry:
        return
    register_flop_formula(forward)(_cpu_flash_forward)
    register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu_backward)(_cpu_flash_backward)


# perfrun's own models, whose forward is a function of their ``config`` and parameters alone
# and gives every trainable parameter a gradient (the memory estimate relies on that too)
OWN_MODELS = ("perfrun.models.gpt", "perfrun.models.llama")
# their counts in this process, by configuration: a sweep's jobs run in one process (Hydra's
# basic launcher) and most share a model, which is then counted once
_counted: dict[tuple[Any, ...], float] = {}
# the largest pass counted on real CPU tensors: about where real arithmetic on one core costs
# what fake tensors take to dispatch a small model's ops; far above it (GPT-2 small at 1,024
# tokens, ~7.6e11 FLOPs) the real pass is many times slower than the fake one
REAL_PASS_FLOPS = 1e9


def _count_key(model: nn.Module, sample: torch.Tensor, target: torch.Tensor) -> tuple[Any, ...] | None:
    """What the count of one of perfrun's own models depends on; None for any other model
    (a user's forward may read what neither its config nor its parameters show)."""
    config = getattr(model, "config", None)
    if type(model).__module__ not in OWN_MODELS or not is_dataclass(config):
        return None
    params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in model.named_parameters())
    return (type(model), repr(config), params, tuple(sample.shape), sample.dtype, tuple(target.shape), target.dtype)


def counted_flops_per_token(model: nn.Module, sample: torch.Tensor, target: torch.Tensor) -> float:
    """Training FLOPs per token of ``model`` (forward + backward), counted on one batch like
    ``sample`` and ``target`` (only their shapes and dtypes matter) without computing it.

    A token is a position of ``sample``: batch x sequence for a (B, T) input."""
    key = _count_key(model, sample, target)
    if key is not None and key in _counted:
        return _counted[key]
    flops = _count(model, sample, target)
    if key is not None:
        _counted[key] = flops
    return flops


def _count(model: nn.Module, sample: torch.Tensor, target: torch.Tensor) -> float:
    register_cpu_attention()
    device = next(model.parameters()).device
    real = _state(model)
    if _small_own_model_on_cpu(model, device, sample):
        with torch.random.fork_rng(devices=[]):  # dropout draws: the run's random stream stays as it was
            return _pass(model, {name: t.clone() for name, t in real.items()}, sample, target)
    with FakeTensorMode() as fake:
        state = {name: fake.from_tensor(t, static_shapes=True) for name, t in real.items()}
        idx, tgt = (fake.from_tensor(t.to(device), static_shapes=True) for t in (sample, target))
        return _pass(model, state, idx, tgt)


def _small_own_model_on_cpu(model: nn.Module, device: torch.device, sample: torch.Tensor) -> bool:
    """Whether real tensors count ``model`` faster than fake ones: one of perfrun's own models
    (its forward reads no value, so both passes count the same ops), on the CPU, with at most
    REAL_PASS_FLOPS in a pass (6 x parameters x tokens, about its FLOPs)."""
    if device.type != "cpu" or type(model).__module__ not in OWN_MODELS:
        return False
    return 6 * sum(p.numel() for p in model.parameters()) * sample.numel() <= REAL_PASS_FLOPS


def _pass(model: nn.Module, state: dict[str, torch.Tensor], idx: torch.Tensor, tgt: torch.Tensor) -> float:
    """FLOPs per token of one forward and backward of ``model`` with ``state`` (copies of its
    parameters and buffers): the gradients are taken with ``autograd.grad``, none is stored."""
    counter = FlopCounterMode(display=False, custom_mapping=_model_flops_mapping())
    trainable = [state[n].requires_grad_(True) for n, p in model.named_parameters()
                 if p.requires_grad and p.is_floating_point()]
    with counter:
        out = torch.func.functional_call(model, state, (idx, tgt))
        loss = out[1] if isinstance(out, tuple) else out
        torch.autograd.grad(loss, trainable, allow_unused=True)
    return counter.get_total_flops() / idx.numel()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and buffers, detached."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: t.detach() for n, t in named.items()}


def agreement(counted: float, formula: float) -> float:
    """How far the counted figure is from the formula's, as a fraction of the formula's."""
    return abs(counted - formula) / formula


@dataclass
class FlopsFigure:
    """MFU's numerator per token: the model's analytic formula where it has one, else the
    count of one forward and backward; both are kept and logged side by side. ``problem``:
    why the count failed (a model FakeTensorMode cannot run), said in the log."""

    counted: float | None
    formula: float | None
    problem: str | None = None

    @property
    def source(self) -> str:
        return "formula" if self.formula is not None else "counted" if self.counted is not None else "none"

    @property
    def per_token(self) -> float:
        """0 where neither figure exists: then MFU is not reported."""
        return self.formula if self.formula is not None else self.counted or 0.0

    def facts(self) -> RunSummary:
        return {"flops_per_token": self.per_token, "flops_per_token_source": self.source,
                "flops_per_token_counted": self.counted, "flops_per_token_formula": self.formula}

    def describe(self) -> str:
        counted = (f"counted {self.counted / 1e6:,.2f}M" if self.counted is not None
                   else f"not counted ({self.problem})")
        if self.formula is None:
            return f"FLOPs per token: {counted}; the model has no formula, " + \
                ("MFU uses the count" if self.counted is not None else "so no MFU")
        apart = f" ({100 * agreement(self.counted, self.formula):.1f}% apart)" if self.counted is not None else ""
        return f"FLOPs per token: formula {self.formula / 1e6:,.2f}M, {counted}{apart}, MFU uses the formula"


def flops_figure(model: nn.Module, example: tuple[torch.Tensor, torch.Tensor], seq_len: int) -> FlopsFigure:
    """Both figures for ``model`` (before any knob wraps it), ``example`` one dataset item."""
    x, y = (t.unsqueeze(0) for t in example)
    given = model.flops_per_token(seq_len) if contract.has(model, "flops") else None  # None: no formula for it
    formula = float(given) if given is not None else None
    try:
        return FlopsFigure(counted_flops_per_token(model, x, y), formula)
    except Exception as e:  # noqa: BLE001 - the user's model under FakeTensorMode: said in the log, not fatal
        return FlopsFigure(None, formula, f"{type(e).__name__}: {first_line(e)}")
