"""``distributed=fsdp``: shard parameters, gradients and optimizer state over the ranks
with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each transformer block is its own shard group, then the root (embeddings, final norm,
tied head), so a block's full weights exist only while it runs. The mixed-precision
policy follows the precision group: parameters are gathered in bf16 or fp16 for
compute, gradients are reduced and kept in fp32 (the optimizer's master copy stays fp32).
Autocast stays on as well, so norms, softmax and the loss run in fp32 exactly as they do
under DDP. Applied after activation checkpointing and before compile, like DDP.

On gradient-accumulation micro-steps but the last, the reduce-scatter is skipped
(``set_requires_gradient_sync(False)``): fewer collectives for unsharded gradients held
a little longer. Checkpoints are written by every rank through
``torch.distributed.checkpoint`` (:func:`perfrun.checkpoint_files.save_sharded`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from perfrun.knobs.precision import DTYPES


def apply(cfg: Any, device: torch.device, plan: Any, stack: ExitStack) -> None:
    if cfg.distributed != "fsdp":
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = DTYPES[cfg.precision.dtype]
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    model = plan.raw_model
    reshard = bool(cfg.fsdp.reshard_after_forward)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    plan.model = model  # fully_shard changes the module in place: raw_model is the sharded one too
    plan.micro_step_context = _sync_on_last(model)
    plan.sharded_state = True
    plan.notes["fsdp"] = {
        "shard_groups": len(model.blocks) + 1,
        "param_dtype": str(policy.param_dtype or torch.float32).removeprefix("torch."),
        "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch."),
        "reshard_after_forward": reshard,
        "backend": torch.distributed.get_backend(),
    }


def _sync_on_last(model: Any) -> Any:
    @contextmanager
    def context(i: int, n: int) -> Iterator[None]:
        model.set_requires_gradient_sync(i == n - 1)
        yield

    return context
