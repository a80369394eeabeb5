"""Dynamic int8 quantisation of the Linear layers, for CPU inference, and its measured report.

API choice (checked on torch 2.13): ``torch.ao.quantization.quantize_dynamic`` still runs
but warns that the quantized-tensor creation functions it uses are deprecated and will be
removed (pytorch/pytorch#184982) and that quantisation has moved to torchao. So perfrun
uses torchao's ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``: weights are
stored as int8 per output channel, activations are quantised per token at run time.
torchao is an optional extra (``pip install perfrun[int8]``); without it the command says
so in one line.

The tied embedding: ``lm_head`` shares its weight with ``wte``. Quantising ``lm_head``
would replace that shared Parameter with an int8 copy (the embedding lookup would keep
the float one, so the model would stay correct but hold the matrix twice). perfrun leaves
``lm_head`` in float by default, so the tie and the exact embedding survive;
``include_head=True`` quantises it too (untied, an int8 head next to the float embedding).

The report (``perfrun export checkpoint=PATH format=int8-report``) measures, on this
machine: the serialized state dict's bytes, generation tokens/s (KV cache, greedy, after
a warm-up), and the validation loss on the checkpoint's own val split, rebuilt with
``perfrun.data.build_datasets`` from the checkpoint's config (with the class typed as
``data.target=`` for ``data=custom``: a recorded one is never imported). Nothing is claimed
that was not measured here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from perfrun.config import ConfigError
from perfrun.environment import quiet_torchao
from perfrun.inference.generation import generate
from perfrun.inference.loading import load_model
from perfrun.inference.sampling import Sampler


@dataclass
class QuantInfo:
    """What was quantised, for the log line."""

    layers: int
    skipped: list[str]
    api: str

    def describe(self) -> str:
        skip = f" ({', '.join(self.skipped)} kept in float)" if self.skipped else ""
        return f"int8 dynamic quantisation of {self.layers} Linear layers via {self.api}{skip}"


def quantize_int8(model: nn.Module, *, include_head: bool = False) -> QuantInfo:
    """Quantise ``model``'s Linear layers in place (CPU inference; the model must be on the CPU)."""
    try:
        with quiet_torchao():
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        raise ConfigError("quantize=int8 needs torchao; install it with pip install 'perfrun[int8]' "
                          "(or pip install torchao)") from None
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError("quantize=int8 is for CPU inference; load the model with device=cpu")
    skipped = [] if include_head else ["lm_head"]

    def chosen(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn not in skipped

    targets = [m for name, m in model.named_modules() if chosen(m, name)]
    with quiet_torchao():  # the model is not compiled here: torchao's inductor settings would only leak
        quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False), filter_fn=chosen)
    still_float = sum(1 for m in targets if type(m.weight) is nn.Parameter)
    if still_float:  # a report of a float model named int8 would be a false measurement
        raise RuntimeError(f"torchao's quantize_ left {still_float} of {len(targets)} Linear layers in float")
    return QuantInfo(len(targets), skipped, "torchao.quantization.quantize_(Int8DynamicActivationInt8WeightConfig)")


def state_dict_bytes(model: nn.Module) -> int:
    """Size of ``torch.save(model.state_dict())``: what a saved model costs on disk (a tied
    weight is stored once, as torch.save keeps shared storage shared)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


@torch.no_grad()
def val_loss(model: nn.Module, dataset: Any, *, batches: int, batch_size: int) -> float:
    """Mean cross-entropy over the first ``batches`` batches of ``dataset`` (in order, so
    the float and int8 models see the same tokens)."""
    total, n = 0.0, 0
    count = min(len(dataset), batches * batch_size)
    if count == 0:
        raise ConfigError("the checkpoint's val split holds no sequence; there is no val loss to compare")
    for lo in range(0, count, batch_size):
        items = [dataset[i] for i in range(lo, min(lo + batch_size, count))]
        x = torch.stack([a for a, _ in items])
        y = torch.stack([b for _, b in items])
        logits = model(x)[0]
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        n += y.numel()
    return total / n


@dataclass
class Int8Report:
    """Float vs int8 on one checkpoint, all measured on this machine."""

    checkpoint: str
    float_bytes: int
    int8_bytes: int
    float_tokens_per_s: float
    int8_tokens_per_s: float
    float_val_loss: float
    int8_val_loss: float
    val_tokens: int
    gen_tokens: int
    threads: int
    quantised: str

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.int8_val_loss - self.float_val_loss) / self.float_val_loss

    def lines(self) -> list[str]:
        return [
            f"int8 report for {self.checkpoint} ({self.quantised}; CPU, {self.threads} threads)",
            f"  size (torch.save state dict): float {self.float_bytes:,} B, int8 {self.int8_bytes:,} B "
            f"({self.int8_bytes / self.float_bytes:.2f}x)",
            f"  generation ({self.gen_tokens} tokens, KV cache, greedy, after a warm-up): float "
            f"{self.float_tokens_per_s:.1f} tokens/s, int8 {self.int8_tokens_per_s:.1f} tokens/s "
            f"({self.int8_tokens_per_s / self.float_tokens_per_s:.2f}x)",
            f"  val loss ({self.val_tokens:,} tokens of the checkpoint's val split): float "
            f"{self.float_val_loss:.4f}, int8 {self.int8_val_loss:.4f} ({100 * self.loss_rel_diff:.2g}% apart)",
        ]


def val_dataset(config: dict[str, Any], block_size: int, data_target: str | None = None,
                checkpoint: Path | str = "the checkpoint") -> Any:
    """The checkpoint's own val split, rebuilt from its config: text the model did not train on.

    A recorded ``data.target`` is never imported: a file names no code that runs. A
    checkpoint of ``data=custom`` is rebuilt with the class the user typed (``data_target``),
    else refused naming the recorded class and the override that gives it. The token cache
    is this machine's (``data.cache_dir`` of the record is another machine's folder)."""
    from dataclasses import replace

    from perfrun.config import DataConfig, from_record
    from perfrun.data import build_datasets

    data_cfg = from_record(DataConfig, config.get("data") or {})
    if data_cfg.name == "custom" and not data_target:
        raise ConfigError(f"checkpoint={checkpoint} was trained on data=custom with data.target={data_cfg.target}; "
                          "perfrun never imports a class that a file names: if that is your own Dataset class, give "
                          f"it on this command line: data.target={data_cfg.target}")
    if data_cfg.name != "custom" and data_target:
        raise ConfigError(f"data.target={data_target} applies to a checkpoint trained on data=custom; checkpoint="
                          f"{checkpoint} was trained on data={data_cfg.name}: drop data.target")
    data_cfg = replace(data_cfg, target=data_target, cache_dir=None)
    seq_len = (config.get("data") or {}).get("seq_len") or block_size
    return build_datasets(data_cfg, int(seq_len), int(config.get("seed", 0))).val


def int8_report(checkpoint: Path, *, val_batches: int = 4, batch_size: int = 4, gen_tokens: int = 64,
                include_head: bool = False, data_target: str | None = None) -> Int8Report:
    """Load the checkpoint twice (float, int8) and measure size, speed and val loss;
    ``data_target``: the user's Dataset class, typed, for a checkpoint of ``data=custom``."""
    flt = load_model(checkpoint, "cpu")
    val = val_dataset(flt.config, flt.model.config.block_size, data_target, flt.path)
    q = load_model(checkpoint, "cpu")
    info = quantize_int8(q.model, include_head=include_head)
    prompt = [int(t) for t in val[0][0][: max(1, flt.model.config.block_size // 4)]]
    n_gen = max(1, min(gen_tokens, flt.model.config.block_size - len(prompt)))

    def speed(model: nn.Module) -> float:
        s = Sampler(0.0, None, flt.vocab_size, 0)
        return generate(model, prompt, n_gen, s, cache=True).tokens_per_s  # type: ignore[arg-type]

    fl = val_loss(flt.model, val, batches=val_batches, batch_size=batch_size)
    ql = val_loss(q.model, val, batches=val_batches, batch_size=batch_size)
    n_val = min(len(val), val_batches * batch_size) * len(val[0][1])
    return Int8Report(str(flt.path), state_dict_bytes(flt.model), state_dict_bytes(q.model), speed(flt.model),
                      speed(q.model), fl, ql, n_val, n_gen, torch.get_num_threads(), info.describe())
