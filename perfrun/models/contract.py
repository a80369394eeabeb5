"""What perfrun needs from a model, written down once; GPT, Llama and a user's own module meet it.

Every model: ``forward(idx, targets) -> (logits or None, loss)``: with targets, the loss the
trainer backpropagates (a scalar tensor). The rest are capabilities a knob or a command needs,
and a model without one simply does not get that knob:

- :class:`RepeatedBlocks`: ``blocks``, an ``nn.ModuleList`` of the repeated layers: activation
  checkpointing, ``compile_options.scope=blocks`` and FSDP2's per-block sharding work on them.
- :class:`OutputHead`: ``lm_head`` (an ``nn.Linear``) and a settable ``loss_fn(hidden, head
  weight, targets)`` that forward calls on the final hidden states: ``loss=chunked`` swaps it.
- :class:`DecoderLM`: ``new_kv_cache``, ``forward_cached`` and ``decode_step``: generate.
- :class:`FlopsFormula`: ``flops_per_token(seq_len)``: MFU uses it, else the counted figure
  (:mod:`perfrun.models.flops`).

:func:`knob_fits` says, for a model and the configured knobs, which apply and which cannot,
naming the missing piece. Only attributes are read, so a model on the meta device will do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from perfrun.models.losses import LossFn

if TYPE_CHECKING:
    from perfrun.config import TrainConfig


@runtime_checkable
class Model(Protocol):
    """What every model gives the trainer."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]: ...


@runtime_checkable
class RepeatedBlocks(Protocol):
    blocks: nn.ModuleList


@runtime_checkable
class OutputHead(Protocol):
    lm_head: nn.Linear
    loss_fn: LossFn


@runtime_checkable
class DecoderLM(Protocol):
    def new_kv_cache(self, batch: int, device: torch.device | str, dtype: torch.dtype,
                     capacity: int | None = None) -> Any: ...

    def forward_cached(self, idx: torch.Tensor, cache: Any, last: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode_step(self, idx: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor: ...


@runtime_checkable
class FlopsFormula(Protocol):
    def flops_per_token(self, seq_len: int) -> int: ...


#: capability -> what the model must have, as the refusal names it
NEEDS = {
    "blocks": "`blocks`, an nn.ModuleList of its repeated layers",
    "head": "`lm_head` (an nn.Linear) and a `loss_fn(hidden, weight, targets)` its forward calls",
    "decoder": "`new_kv_cache`, `forward_cached` and `decode_step` (a decoder LM's KV cache and decode step)",
    "flops": "`flops_per_token(seq_len)`, an analytic FLOPs formula",
    "linear": "an nn.Linear layer (FP8 converts those)",
    "attention": "`config.attention`, read by its layers (perfrun's own families); otherwise the model's code picks",
}


def has(model: nn.Module, capability: str) -> bool:
    """Whether ``model`` has ``capability`` (a key of :data:`NEEDS`)."""
    if capability == "blocks":
        return isinstance(getattr(model, "blocks", None), nn.ModuleList) and len(model.blocks) > 0
    if capability == "head":
        return isinstance(getattr(model, "lm_head", None), nn.Linear) and callable(getattr(model, "loss_fn", None))
    if capability == "decoder":
        return isinstance(model, DecoderLM)
    if capability == "flops":
        return callable(getattr(model, "flops_per_token", None))
    if capability == "linear":
        return any(isinstance(m, nn.Linear) for m in model.modules())
    if capability == "attention":
        return getattr(getattr(model, "config", None), "attention", None) in ("sdpa", "eager")
    raise ValueError(f"unknown capability {capability}; one of {', '.join(NEEDS)}")


def missing(model: nn.Module, capability: str, what: str) -> str | None:
    """One line naming the missing piece where ``model`` lacks ``capability``, else None."""
    if has(model, capability):
        return None
    return f"{what} needs {NEEDS[capability]}, which {type(model).__name__} does not have"


@dataclass(frozen=True)
class KnobFit:
    """One configured knob on one model: whether it applies, and why not."""

    knob: str  # as the user sets it: "loss=chunked"
    key: str  # the config key: "loss"
    applies: bool
    reason: str  # what it needs (applies) or the missing piece (does not)
    refused: bool = False  # the run cannot go on with it (else it merely does not act)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fit(model: nn.Module, knob: str, key: str, capability: str, *, refuse: bool = True) -> KnobFit:
    why = missing(model, capability, knob)
    if why is None:
        return KnobFit(knob, key, True, f"uses {NEEDS[capability].split(',')[0]}")
    return KnobFit(knob, key, False, why, refused=refuse)


def knob_fits(model: nn.Module, cfg: TrainConfig) -> list[KnobFit]:
    """Every knob ``cfg`` turns on that needs something of the model, and the others that any
    model takes, each with whether it applies to ``model``."""
    fits: list[KnobFit] = [_fit(model, f"attention={cfg.attention}", "attention", "attention", refuse=False)]
    if cfg.checkpointing.name != "none":
        fits.append(_fit(model, f"checkpointing={cfg.checkpointing.name}", "checkpointing", "blocks"))
    if cfg.compile and cfg.compile_options.scope == "blocks":
        fits.append(_fit(model, "compile_options.scope=blocks", "compile_options.scope", "blocks"))
    if cfg.distributed == "fsdp":
        fits.append(_fit(model, "distributed=fsdp", "distributed", "blocks"))
    if cfg.loss.name == "chunked":
        fits.append(_fit(model, "loss=chunked", "loss", "head"))
    if cfg.precision.name == "fp8":
        fits.append(_fit(model, "precision=fp8", "precision", "linear"))
    anything = [f"precision={cfg.precision.name}", f"precision.tf32={bool(cfg.precision.tf32)}",
                f"compile={bool(cfg.compile)}", f"optim.fused={cfg.optim.fused}",
                f"dataloader.num_workers={cfg.dataloader.num_workers}",
                f"dataloader.device_input={bool(cfg.dataloader.device_input)}",
                f"accumulation.steps={cfg.accumulation.steps}", f"distributed={cfg.distributed}"]
    taken = {f.knob for f in fits}
    fits += [KnobFit(k, k.split("=")[0], True, "acts on any model") for k in anything if k not in taken]
    return fits


def refused(fits: list[KnobFit]) -> KnobFit | None:
    """The first knob the run cannot go on with, if any."""
    return next((f for f in fits if f.refused), None)


def describe(fits: list[KnobFit]) -> list[str]:
    """The log's lines: what applies, then each knob that does not with why."""
    applies = [f.knob for f in fits if f.applies]
    lines = [f"knobs that apply to this model: {', '.join(applies) or 'none'}"]
    lines += [f"{'refused' if f.refused else 'does not act'}: {f.reason}" for f in fits if not f.applies]
    return lines


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``params`` and ``params_non_embedding``: the model's own count where it has one
    (GPT leaves out its position embedding), else every parameter less the nn.Embedding ones."""
    if callable(getattr(model, "num_params", None)):
        return {"params": int(model.num_params(non_embedding=False)), "params_non_embedding": int(model.num_params())}
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return {"params": total, "params_non_embedding": total - embedding}


def model_class(model: nn.Module) -> str:
    """The class trained: a wrapper's ``architecture_class`` (model=hf: transformers' class), else the model's."""
    cls = getattr(model, "architecture_class", type(model))
    return f"{cls.__module__}.{cls.__qualname__}"
