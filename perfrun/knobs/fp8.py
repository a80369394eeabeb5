"""FP8 training (``precision=fp8``): torchao's float8 Linear layers, bf16 autocast for the rest.

``torchao.float8.convert_to_float8_training`` swaps ``nn.Linear`` layers for
``Float8Linear``: each matmul of the forward and the backward casts its operands to
float8 with dynamic scales (``precision.recipe=tensorwise``: one scale per tensor, the
cuBLAS kernel; ``rowwise``: one per row, the CUTLASS kernel) and keeps the fp32 master
weights. Everything else runs under the bf16 autocast of ``precision=fp8``'s dtype.

Layers stay in bf16 where FP8 cannot take them, and the run says which and why
(``knobs.fp8.kept_in_bf16`` in summary.json): a dimension that is not a multiple of 16
(the FP8 tensor-core matmuls need multiples of 16), or a weight tied to another module
(GPT-2's ``lm_head`` shares the token embedding, which the embedding lookup reads as a
plain matrix). Parameter names do not change, so checkpoints load in bf16 and back.

FP8 matmuls need tensor cores of compute capability 8.9 or higher (Ada, Hopper,
Blackwell); anywhere else, or without torchao, :func:`check` refuses in one line.
``convert_to_float8_training`` also reverts one Triton code-generation rule of inductor
process-wide (torchao's workaround for a Triton fp8 store bug, numerically identical); it
is left in place after the job because torchao applies it only once per process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from perfrun.config import CHOICES, ConfigError, TrainConfig
from perfrun.device_conditions import FP8_MIN_CAPABILITY
from perfrun.environment import torchao_available
from perfrun.knobs.refusal import KnobRefused

log = logging.getLogger("perfrun")

RECIPES = CHOICES["precision.recipe"]
MIN_CAPABILITY = FP8_MIN_CAPABILITY
ALIGN = 16  # every dimension of an FP8 tensor-core matmul is a multiple of this


def refusal(device_type: str, capability: tuple[int, int] | None, has_torchao: bool, gpu: str = "") -> str | None:
    """Why FP8 training cannot run here (one line with the fix), or None where it can."""
    if device_type != "cuda":
        return (f"precision=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or higher: "
                f"Ada, Hopper, Blackwell) but the device is {device_type}; use precision=bf16")
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        cc = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (f"precision=fp8 needs FP8 tensor cores (compute capability 8.9 or higher) but {gpu or 'this GPU'} "
                f"has compute capability {cc}; use precision=bf16")
    if not has_torchao:
        return ("precision=fp8 trains through torchao's float8 layers and torchao is not installed; "
                "install it with pip install torchao, or use precision=bf16")
    return None


def check(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse FP8 where it cannot run, before any work (call it as soon as the device is known)."""
    if cfg.precision.name != "fp8":
        return
    recipe = cfg.precision.recipe
    if recipe not in RECIPES:
        raise ConfigError(f"precision.recipe={recipe} is not an option; choose one of {', '.join(RECIPES)}")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    reason = refusal(device.type, capability, device.type == "cuda" and torchao_available(), gpu)
    if reason is not None:
        raise ConfigError(reason)


@dataclass
class Fp8Layers:
    """Which Linear layers become Float8Linear and which stay in bf16, with the reason."""

    convert: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    pad_inner_dim: bool = False  # tokens per micro-batch padded to a multiple of 16 in each matmul


def choose_layers(model: nn.Module) -> Fp8Layers:
    """Sort the model's Linear layers into those FP8 can take and those it cannot (and why)."""
    owners = Counter(id(p) for _, m in model.named_modules(remove_duplicate=False) for p in m.parameters(recurse=False))
    owner_of = {id(p): f"{name}.{pname}" for name, m in model.named_modules()
                for pname, p in m.named_parameters(recurse=False) if not isinstance(m, nn.Linear)}
    # an output head whose weight the loss takes (loss_fn(hidden, lm_head.weight, targets)) is never
    # called as a module: converted, it would be listed as FP8 and still run in the autocast dtype
    head = getattr(model, "lm_head", None) if callable(getattr(model, "loss_fn", None)) else None
    layers = Fp8Layers()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_f, in_f = module.weight.shape
        if owners[id(module.weight)] > 1:
            other = owner_of.get(id(module.weight), "another module")
            layers.kept[name] = f"weight tied to {other}, which reads it as a plain matrix"
        elif module is head:
            layers.kept[name] = "the output head: the loss reads its weight as a plain matrix, never calling the layer"
        elif in_f % ALIGN or out_f % ALIGN:
            layers.kept[name] = f"{in_f} -> {out_f} features: FP8 matmuls need multiples of {ALIGN}"
        else:
            layers.convert.append(name)
    return layers


def convert(model: nn.Module, recipe: str, *, tokens: int | None = None, emulate: bool = False) -> Fp8Layers:
    """Swap the layers FP8 can take for torchao's Float8Linear, in place.

    ``tokens``: rows per micro-batch (batch x sequence, :func:`inner_rows`), the inner
    dimension of the weight gradient's matmul, which FP8 also needs in multiples of 16:
    otherwise (or unknown) torchao pads it, at the cost of a copy per matmul.
    ``emulate`` runs the float8 matmuls in fp32 arithmetic (torchao's test mode, which runs
    on the CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layers = choose_layers(model)
    if not layers.convert:
        reasons = sorted(set(layers.kept.values())) or ["the model has no Linear layer"]
        raise KnobRefused("precision=fp8", f"precision=fp8: no Linear layer can run in FP8 ({reasons[0]}); "
                          "use precision=bf16, or model.n_embd a multiple of 16")
    layers.pad_inner_dim = tokens is None or tokens % ALIGN != 0
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 pad_inner_dim=layers.pad_inner_dim)
    wanted = set(layers.convert)
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in wanted, config=config)
    return layers


def inner_rows(batch: Any, seq_len: int) -> int | None:
    """Rows per micro-batch (batch x sequence), the weight gradient's inner dimension, for
    :func:`convert`. With ``batch_size=auto`` the batch is not known yet, but any batch times
    a sequence length that is a multiple of 16 is one too, so the sequence length stands in
    for it; otherwise the answer is unknown (None) and torchao pads."""
    if isinstance(batch, int):
        return batch * seq_len
    return seq_len if seq_len % ALIGN == 0 else None


def apply(cfg: TrainConfig, device: torch.device, plan: Any, stack: ExitStack) -> None:
    """Convert the plain model before any wrapper (checkpointing, DDP, FSDP, compile) sees it."""
    if cfg.precision.name != "fp8":
        return
    check(cfg, device)
    seq_len = int(cfg.data.seq_len or cfg.model.block_size)
    layers = convert(plan.raw_model, cfg.precision.recipe, tokens=inner_rows(cfg.dataloader.batch_size, seq_len))
    plan.notes["fp8"] = {"recipe": cfg.precision.recipe, "library": "torchao.float8.convert_to_float8_training",
                         "converted": len(layers.convert), "kept_in_bf16": layers.kept,
                         "pad_inner_dim": layers.pad_inner_dim}
    kept = "; ".join(f"{name} ({why})" for name, why in layers.kept.items()) or "none"
    log.info(f"precision=fp8 ({cfg.precision.recipe}): {len(layers.convert)} Linear layers in FP8; kept in bf16: {kept}")
