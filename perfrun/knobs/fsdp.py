"""``distributed=fsdp``: shard parameters, gradients and optimizer state over the ranks
with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each transformer block is its own shard group, then the root (embeddings, final norm,
tied head), so a block's full weights exist only while it runs. The mixed-precision
policy follows the precision group: parameters are gathered in bf16 or fp16 for
compute, gradients are reduced and kept in fp32 (the optimizer's master copy stays fp32).
Autocast stays on as well, so norms, softmax and the loss run in fp32 exactly as they do
under DDP. Applied after activation checkpointing and before compile, like DDP, so that
``compile_options.scope=blocks`` compiles each sharded block's ``forward`` and FSDP2's
hooks (module hooks, run by ``__call__``) stay outside the compiled code.

FSDP2's cost on few ranks is host time: Python hooks per shard group per pass. Three
settings trim what the hooks do, each named in the summary:

- ``fsdp.reshard_last_block=false`` (the default, as in torchtitan and as FSDP2 itself
  treats the root): the last block and the root keep their gathered weights from the
  forward to the backward, which starts with them, so their reshard and the all-gather
  just after it are skipped, for one block's and the root's weights held a little longer.
  ``true`` frees them like every other block.
- ``fsdp.forward_prefetch=N`` / ``fsdp.backward_prefetch=N``: each block issues the
  all-gathers of the next N blocks (towards the first block in the backward) right after
  its own (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``),
  earlier from the host than FSDP2's implicit one-ahead prefetch; N >= 2 overlaps more for
  N blocks' weights in flight. 0 keeps FSDP2's implicit prefetching.

On gradient-accumulation micro-steps but the last, the reduce-scatter is skipped
(``set_requires_gradient_sync(False)``): fewer collectives for unsharded gradients held
a little longer. Checkpoints are written by every rank through
``torch.distributed.checkpoint`` (:func:`perfrun.checkpoint.files.save_sharded`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from perfrun.config import ConfigError, FsdpOptions, TrainConfig
from perfrun.knobs.precision import DTYPES
from perfrun.knobs.refusal import need

PREFETCH_KEYS = ("forward_prefetch", "backward_prefetch")


def check(cfg: TrainConfig) -> None:
    """Refuse ``fsdp.*`` values out of range or with nothing to act on, before any work."""
    opts, blocks = cfg.fsdp, cfg.model.n_layer
    for key in PREFETCH_KEYS:
        n = getattr(opts, key)
        if n < 0:
            raise ConfigError(f"fsdp.{key}={n} must be >= 0 (blocks prefetched ahead; 0 leaves it to FSDP2); "
                              f"set fsdp.{key}=0 or more")
        if n >= blocks:
            raise ConfigError(f"fsdp.{key}={n} reaches past the model's {blocks} block(s): a block can prefetch at "
                              f"most the {blocks - 1} others; set fsdp.{key}={blocks - 1} or less")
    if opts.reshard_last_block and not opts.reshard_after_forward:
        raise ConfigError("fsdp.reshard_last_block=true frees the last block's weights after forward, but "
                          "fsdp.reshard_after_forward=false keeps every block's; drop one of the two")
    new = [f"fsdp.{key}={str(getattr(opts, key)).lower()}" for key in ("reshard_last_block", *PREFETCH_KEYS)
           if getattr(opts, key) != getattr(FsdpOptions, key)]
    if new and cfg.distributed != "fsdp":
        raise ConfigError(f"{', '.join(new)} sets how FSDP2 gathers the weights, but distributed={cfg.distributed}; "
                          f"add distributed=fsdp or drop {'them' if len(new) > 1 else 'it'}")


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    if cfg.distributed != "fsdp":
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    opts = cfg.fsdp
    dtype = DTYPES[cfg.precision.dtype]
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    model = plan.raw_model
    reshard = bool(opts.reshard_after_forward)
    need(model, "blocks", "distributed=fsdp")
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard and (not last or opts.reshard_last_block))
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard and bool(opts.reshard_last_block))
    set_prefetch(blocks, int(opts.forward_prefetch), int(opts.backward_prefetch))
    plan.model = model  # fully_shard changes the module in place: raw_model is the sharded one too
    plan.micro_step_context = _sync_on_last(model)
    plan.sharded_state = True
    plan.notes["fsdp"] = {
        "shard_groups": len(blocks) + 1,
        "param_dtype": str(policy.param_dtype or torch.float32).removeprefix("torch."),
        "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch."),
        "reshard_after_forward": reshard,
        "reshard_last_block": bool(opts.reshard_last_block),
        "forward_prefetch": int(opts.forward_prefetch),
        "backward_prefetch": int(opts.backward_prefetch),
        "backend": torch.distributed.get_backend(),
    }


def set_prefetch(blocks: list[Any], forward: int, backward: int) -> None:
    """Block i prefetches blocks i+1..i+forward in the forward and i-1..i-backward in the
    backward (torch's FSDP2 example); 0 leaves FSDP2's implicit prefetching in place."""
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1:i + 1 + forward]
        behind = blocks[max(0, i - backward):i][::-1]
        if forward and ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if backward and behind:
            block.set_modules_to_backward_prefetch(behind)


def _sync_on_last(model: Any) -> Any:
    @contextmanager
    def context(i: int, n: int) -> Iterator[None]:
        model.set_requires_gradient_sync(i == n - 1)
        yield

    return context
