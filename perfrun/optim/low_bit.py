"""AdamW's moments in 8 or 4 bits (``optim=adamw8bit|adamw4bit``): torchao's optimizers,
their state saved as plain tensors, and its size.

torchao keeps each moment of a tensor of 4096 values or more as a tensor subclass (block-wise
codes, scales and a quantization map); smaller tensors keep fp32 moments. A checkpoint is read
with torch's weights-only unpickler, which makes no tensor subclass, so the optimizer's
``state_dict`` holds each subclass as its parts (``codes``, ``scale``, ``qmap``, ``signed``)
and ``load_state_dict`` builds it again from them: the codes come back exactly, so a resumed
run continues bit for bit. Only the two classes named in :data:`_STATE_CLASSES` are built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from perfrun.config import ConfigError, OptimConfig

LOW_BIT = ("adamw8bit", "adamw4bit")
_PARTS = "low_bit_state"  # the key that marks a moment saved as its parts


def _state_classes() -> dict[str, type[torch.Tensor]]:
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    return {"8bit": OptimState8bit, "4bit": OptimState4bit}


def build_low_bit(groups: Iterable[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit or AdamW4bit over ``groups``, its state saved as plain tensors."""
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[cfg.name]
    opt = cls(list(groups), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    opt.register_state_dict_post_hook(_as_parts)
    opt.register_load_state_dict_pre_hook(_from_parts)
    return opt


def check(cfg: OptimConfig, distributed: str) -> None:
    """Refuse what the low-bit state is not known to do right, before anything is built."""
    if cfg.name not in LOW_BIT:
        return
    if cfg.fused == "true":
        raise ConfigError(f"optim={cfg.name} has no fused kernel (torchao compiles its own step); "
                          "set optim.fused=auto")
    if distributed != "none":
        raise ConfigError(f"optim={cfg.name} with distributed={distributed}: its sharded or replicated state "
                          "is not measured correct yet; use optim=adamw or distributed=none")


def _as_parts(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with each low-bit moment as its parts (the live state untouched)."""
    classes = {cls: tag for tag, cls in _state_classes().items()}
    state = {}
    for key, entry in state_dict["state"].items():
        state[key] = {name: _parts(value, classes[type(value)]) if type(value) in classes else value
                      for name, value in entry.items()}
    return {**state_dict, "state": state}


def _parts(value: torch.Tensor, tag: str) -> dict[str, Any]:
    names, (signed, *rest) = value.__tensor_flatten__()  # torch's tensor-subclass protocol
    parts: dict[str, Any] = {_PARTS: tag, "signed": bool(signed), **{n: getattr(value, n) for n in names}}
    if tag == "4bit":
        parts["shape"] = list(rest[0])  # 4-bit codes pack two values a byte: the moment's shape apart
    return parts


def _from_parts(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each saved moment built again as torchao's subclass."""
    classes = _state_classes()
    state = {}
    for key, entry in state_dict["state"].items():
        state[key] = {name: _built(value, classes) if isinstance(value, dict) and _PARTS in value else value
                      for name, value in entry.items()}
    return {**state_dict, "state": state}


def _built(parts: dict[str, Any], classes: dict[str, type[torch.Tensor]]) -> torch.Tensor:
    tag = parts[_PARTS]
    if tag not in classes:
        raise ConfigError(f"the checkpoint's optimizer state names '{tag}', not an 8- or 4-bit state; "
                          "resume it with the optimizer that saved it")
    args: list[Any] = [parts["codes"], parts["scale"], parts["qmap"], bool(parts["signed"])]
    if tag == "4bit":
        args.append(torch.Size(parts["shape"]))
    return classes[tag](*args)


# torchao's layout of one moment of a tensor it quantizes: (block size, code bytes per value,
# quantization-map entries); smaller tensors, or those the block does not divide, keep fp32
_LAYOUT = {"adamw8bit": (256, 1.0, 256), "adamw4bit": (128, 0.5, 16)}
QUANTIZED_FROM = 4096  # torchao quantizes tensors of this many values and more (bitsandbytes' rule)


def state_bytes(name: str, numels: Iterable[int]) -> int:
    """The bytes of AdamW's two moments and step counter for parameters of ``numels`` values,
    under optimizer ``name``: torchao's layout for the low-bit ones (codes, an fp32 scale per
    block and an fp32 map, each moment), as its state holds them (tests/test_memory_knobs.py
    holds the figure to a real optimizer's)."""
    total = 0
    for n in numels:
        total += 4  # the step counter, one fp32 scalar a parameter (fused AdamW's and torchao's)
        if name in _LAYOUT and n >= QUANTIZED_FROM and n % _LAYOUT[name][0] == 0:
            block, code_bytes, qmap = _LAYOUT[name]
            total += 2 * (int(n * code_bytes) + 4 * (n // block) + 4 * qmap)
        else:
            total += 2 * 4 * n
    return total
