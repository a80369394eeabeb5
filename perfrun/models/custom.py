"""``model=custom model.target=...``: the user's own nn.Module, built and checked.

``target`` is ``pkg.module.ClassName`` (a module on the Python path) or
``path/to/file.py:ClassName``; the class is called with ``args`` as keyword arguments.
Importing it runs the user's own code, which is the point; nothing perfrun reads (config,
checkpoints, data files) runs code. Each failure is one ConfigError line: an unknown target,
a class that raises in ``__init__``, a forward that does not return ``(logits or None, loss)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from perfrun.config import ConfigError
from perfrun.console import first_line
from perfrun.user_code import instantiate


def build_custom(target: str, args: Mapping[str, Any]) -> nn.Module:
    """The user's model; refused where it is no nn.Module."""
    model = instantiate(target, args, "model.target")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={target} built a {type(model).__name__}, not a torch.nn.Module; "
                          "point model.target at an nn.Module subclass")
    return model


def check_forward(model: nn.Module, sample: torch.Tensor, target: torch.Tensor, name: str) -> None:
    """One forward on a batch of one: it must return (logits or None, a scalar loss tensor)."""
    try:
        out = model(sample.unsqueeze(0), target.unsqueeze(0))
    except Exception as e:  # noqa: BLE001 - the user's forward
        raise ConfigError(f"model {name}: forward(idx, targets) raised {type(e).__name__}: {first_line(e)}; "
                          "it must take a batch of the dataset's inputs and targets") from None
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].numel() == 1 \
        and out[1].is_floating_point() and out[1].requires_grad
    if not ok:
        got = (f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__)
        raise ConfigError(f"model {name}: forward(idx, targets) returned {got}; it must return (logits or None, loss) "
                          "with loss a scalar tensor that requires grad (perfrun.models.contract.Model)")
