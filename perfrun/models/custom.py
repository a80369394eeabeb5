"""``model=custom model.target=...``: the user's own nn.Module, built and checked.

``target`` is ``pkg.module.ClassName`` (a module on the Python path) or
``path/to/file.py:ClassName``; the class is called with ``args`` as keyword arguments.
Importing it runs the user's own code, which is the point; nothing perfrun reads (config,
checkpoints, data files) runs code. Each failure is one ConfigError line: an unknown target,
a class that raises in ``__init__``, a module with nothing to train, a forward that does not
return ``(logits or None, loss)``.
"""

from __future__ import annotations

import inspect
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
    if not any(p.requires_grad for p in model.parameters()):
        found = sum(1 for _ in model.parameters())
        raise ConfigError(f"model.target={target} has no parameters to train ({found} parameters, none requiring grad): "
                          "there is nothing for the optimizer to step; make its layers in __init__ as attributes "
                          "(self.layer = nn.Linear(...)) or nn.Parameter(...)")
    return model


def model_vocab(model: nn.Module) -> tuple[int, str] | None:
    """The number of token ids the user's model takes, and where that was read: its
    ``vocab_size`` or ``config.vocab_size``, else the rows of its one nn.Embedding (with
    several, which one embeds the tokens is not known); None when it says nothing of it."""
    for where, value in (("vocab_size", getattr(model, "vocab_size", None)),
                         ("config.vocab_size", getattr(getattr(model, "config", None), "vocab_size", None))):
        if isinstance(value, int) and not isinstance(value, bool):
            return value, where
    embeddings = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if len(embeddings) == 1:
        name, embedding = embeddings[0]
        return embedding.num_embeddings, f"{name}.num_embeddings"
    return None


def check_vocab(model: nn.Module, target: str, data_vocab: int, data_name: str) -> None:
    """The data's ids must fit the user's model's vocabulary: refused, naming both and the key
    to set, before the first forward (which would fail on an index out of range)."""
    found = model_vocab(model)
    if found is None or data_vocab < 2 or found[0] >= data_vocab:
        return
    vocab, where = found
    takes = "vocab_size" in inspect.signature(type(model)).parameters
    model_fix = (f"model.args.vocab_size={data_vocab}" if takes else f"a model built for {data_vocab} ids")
    data_fix = f"data.vocab_size={vocab} (random ids below it), or " if data_name == "synthetic" else ""
    raise ConfigError(f"model.target={target} takes token ids below {vocab} (its {where}) but data={data_name} has "
                      f"a vocabulary of {data_vocab}; set {data_fix}{model_fix}")


def check_forward(model: nn.Module, sample: torch.Tensor, target: torch.Tensor, name: str) -> None:
    """One forward on a batch of one: it must return (logits or None, a scalar loss tensor)."""
    try:
        out = model(sample.unsqueeze(0), target.unsqueeze(0))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's forward (an exit in it too)
        raise ConfigError(f"model {name}: forward(idx, targets) raised {type(e).__name__}: {first_line(e)}; "
                          "it must take a batch of the dataset's inputs and targets") from None
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].numel() == 1 \
        and out[1].is_floating_point() and out[1].requires_grad
    if not ok:
        got = (f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__)
        raise ConfigError(f"model {name}: forward(idx, targets) returned {got}; it must return (logits or None, loss) "
                          "with loss a scalar tensor that requires grad (perfrun.models.contract.Model)")
