"""The process group, each rank's device and random streams, and the few collectives the
trainer needs, for a world of any size.

A single process is rank 0 of a world of one, and every helper here is then a no-op, so
the trainer calls them unconditionally. Under torchrun (``WORLD_SIZE`` > 1) the group is
usually made by :func:`perfrun.commands.train.train_main` before Hydra starts, so that rank 0 can
hand every rank the same run dir; :func:`ensure_group` makes it otherwise.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from perfrun.config import ConfigError
from perfrun.devices import resolve_device


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


# A CPU (gloo) group beside NCCL for the per-step stop flag, so that agreeing on it never
# drains the GPU queue; None where the main group is gloo already.
_control: Any = None


def init_from_env(device_type: str) -> None:
    """Join torchrun's group (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    global _control
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend_for(device_type))
    if device_type == "cuda":  # host-side flags travel over gloo: no GPU synchronisation
        _control = dist.new_group(backend="gloo")


def ensure_group(device: torch.device) -> bool:
    """Make the group if nobody has; True when this call made it (and must destroy it).

    Without torchrun this is a world of one on an in-memory store: DDP and FSDP then run
    their real code paths (hooks, no_sync, sharding over one rank) with nothing to talk to,
    which tests and scripts/bench_distributed.py use.
    """
    if active():
        return False
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:  # started by torchrun, even as a world of one
        init_from_env(device.type)
    else:
        dist.init_process_group(backend_for(device.type), store=dist.HashStore(), rank=0, world_size=1)
    return True


def destroy() -> None:
    global _control
    if active():
        dist.destroy_process_group()
    _control = None


def setup_device(spec: str, mode: str, stack: ExitStack) -> torch.device:
    """This process's device (``device=spec``); under ``distributed=ddp|fsdp`` the GPU of its
    LOCAL_RANK, and the process group, made here if nobody made it and destroyed with ``stack``."""
    device = resolve_device(spec)
    if mode != "none":
        device = rank_device(spec, mode, device)
        if ensure_group(device):
            stack.callback(destroy)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.empty_cache()
    return device


def rank_device(spec: str, mode: str, device: torch.device) -> torch.device:
    """Under DDP or FSDP each process of a machine owns the GPU of its LOCAL_RANK; a world
    of one that torchrun did not start keeps the device it was given (cuda:N)."""
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ:
        return device
    index = local_rank()
    if spec not in ("auto", "cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"device={spec} with distributed={mode}: each rank takes cuda:LOCAL_RANK; "
                          "set device=auto or device=cuda")
    if index >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={index} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                          "start at most that many processes per node")
    return torch.device("cuda", index)


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators, so that a run repeats exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int) -> None:
    """Ranks share the model's initial weights (one seed) but not their dropout masks:
    after the model is built, rank r draws from ``seed + r``."""
    torch.manual_seed(seed + rank)


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a barrier too)."""
    if not active() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on one: ranks must stop at the same step.

    A host tensor over a gloo group: called after every step, it must not synchronise the
    GPU (a CUDA tensor over NCCL would, through ``.item()``)."""
    if not active() or world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control)
    return bool(t.item())


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere). Host objects over
    the gloo group, so that gathering telemetry or RNG states never touches the GPU queue."""
    if not active() or world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_control)
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's gradient norm, for one) as the plain tensor it stands for."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The average of ``t`` over ranks (a loss summed per rank -> the global batch's loss)."""
    if not active() or world_size() == 1:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / world_size()


def no_sync_factory(ddp_model: Any) -> Callable[[int, int], AbstractContextManager[Any]]:
    """Micro-step i of n skips DDP's gradient all-reduce unless it is the last one."""

    def context(i: int, n: int) -> AbstractContextManager[Any]:
        return ddp_model.no_sync() if i < n - 1 else nullcontext()

    return context
