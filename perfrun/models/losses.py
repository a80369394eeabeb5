"""The language-model loss: the head's matmul and the cross-entropy, standard or chunked.

``loss=standard`` computes the logits of every token at once, as nanoGPT does: for GPT-2
at batch 16 and sequence 1024 that is a 16 x 1024 x 50304 tensor, kept for the backward
and cast to fp32 for the softmax (3.3 GB in fp32). ``loss=chunked`` walks the batch x
sequence rows ``loss.chunk_size`` at a time, in the forward and again in the backward
(each chunk's logits are recomputed there rather than kept), so no more than one chunk's
logits exist at any moment. The price is one more head matmul per step (the recompute);
the gain is memory, which a larger batch can turn into speed.

torch 2.13 has ``F.linear_cross_entropy`` with a chunked path, but its documentation says
``torch.compile`` falls back to eager at that op (a graph break in every step), so the
chunked path here is a plain ``torch.autograd.Function`` that dynamo traces whole.

Both functions take ``(hidden, weight, targets)``: hidden states ``(..., C)``, the head's
weight ``(V, C)`` (GPT-2's is the token embedding, tied) and targets of hidden's leading
shape. Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as
the standard path does.

The ``loss`` group's schema (:class:`LossConfig`, ``LOSSES``) lives in ``perfrun/config.py``
with the others, which imports no torch (shell completion runs without it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.nn import functional as F

from perfrun.config import LOSSES, LossConfig

__all__ = ["LOSSES", "LossConfig", "LossFn", "build", "chunked_linear_cross_entropy", "standard_linear_cross_entropy"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def standard_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    chunk_size: int | None = None, ignore_index: int = -1,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, all rows at once
    (``chunk_size`` is accepted for a common signature and unused)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    chunk_size: int, ignore_index: int = -1,
) -> torch.Tensor:
    """The same mean as :func:`standard_linear_cross_entropy`, ``chunk_size`` rows at a time
    in the forward and the backward: the full logits never exist."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    flat = hidden.reshape(-1, hidden.size(-1))
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), chunk_size, ignore_index, compute)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss chunk by chunk. Backward: each chunk's logits again, their
    softmax minus the one-hot target, and from that the chunk's rows of grad(hidden) and its
    share of grad(weight), accumulated in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
        chunk_size: int, ignore_index: int, compute: torch.dtype,
    ) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes below are explicit
            w = weight.to(compute)
            total = hidden.new_zeros((), dtype=torch.float32)
            for lo in range(0, hidden.size(0), chunk_size):
                logits = hidden[lo:lo + chunk_size].to(compute) @ w.t()
                total = total + F.cross_entropy(logits.float(), targets[lo:lo + chunk_size],
                                                ignore_index=ignore_index, reduction="sum")
            count = (targets != ignore_index).sum()
        ctx.save_for_backward(hidden, weight, targets, count)
        ctx.chunk_size, ctx.ignore_index, ctx.compute = chunk_size, ignore_index, compute
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets, count = ctx.saved_tensors
        step, compute = ctx.chunk_size, ctx.compute
        scale = grad_out / count
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for lo in range(0, hidden.size(0), step):
                h = hidden[lo:lo + step].to(compute)
                t = targets[lo:lo + step]
                valid = t != ctx.ignore_index
                grad_logits = torch.softmax((h @ w.t()).float(), dim=-1)
                grad_logits.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1),
                                         -valid.to(grad_logits.dtype).unsqueeze(1))
                grad_logits = (grad_logits * (valid.unsqueeze(1) * scale)).to(compute)
                grad_hidden[lo:lo + step] = (grad_logits @ w).to(hidden.dtype)
                grad_weight += (grad_logits.t() @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


LOSS_FUNCTIONS = {"standard": standard_linear_cross_entropy, "chunked": chunked_linear_cross_entropy}


def build(cfg: LossConfig | Any) -> LossFn:
    """The loss function the ``loss`` group names, as ``fn(hidden, weight, targets)``
    (``config.validate`` has checked the name and the chunk size)."""
    return partial(LOSS_FUNCTIONS[cfg.name], chunk_size=int(cfg.chunk_size))
