"""The ``model`` group's schema and the checks its types cannot make.

It lives apart from :mod:`perfrun.config` (which imports it and registers it) so that the
schema of each family sits in one short place; like config, it imports no torch (shell
completion reads it). ``family`` picks the architecture: ``gpt`` (GPT-2's, perfrun/models/gpt.py)
or ``llama`` (perfrun/models/llama.py), ``hf``: a Hugging Face folder (``model.path``) that
transformers builds (perfrun/models/hf.py), or ``custom``: the user's own nn.Module, ``model.target``
built with ``model.args`` (perfrun/models/custom.py). The Llama fields mean nothing to GPT, so a GPT model
that sets one away from its default is refused rather than silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

FAMILIES = ("gpt", "llama", "hf", "custom")
HF_INITS = ("auto", "pretrained", "random")


@dataclass
class RopeScalingConfig:
    """Llama 3's frequency scaling of RoPE (``rope_type: llama3`` in a Hugging Face config):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    ``factor``, those shorter than .../ high_freq_factor are kept, the band between is blended.
    ``factor: 1.0`` leaves every frequency as it is (no scaling)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    name: str = "tiny"
    family: str = "gpt"  # gpt | llama
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    dropout: float = 0.0
    bias: bool = True  # gpt only: Llama has no biases
    init_from: str | None = None  # a Hugging Face GPT-2 or Llama folder whose weights start the run (models/pretrained.py)
    # llama only:
    n_kv_head: int | None = None  # grouped-query attention: key/value heads; None: n_head (multi-head)
    intermediate_size: int | None = None  # SwiGLU's hidden size; None: Llama's rule from multiple_of, ffn_dim_multiplier
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = True  # the head shares the token embedding's weight (GPT always does)
    # custom only: the class (pkg.module.Class or path/to/file.py:Class) and its keyword arguments
    target: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    # hf only: the Hugging Face folder (config.json, safetensors weights) and where the weights start:
    # auto (the folder's where it has them, else random), pretrained (required), random (the config's init)
    path: str | None = None
    init: str = "auto"


LLAMA_ONLY = ("n_kv_head", "intermediate_size", "multiple_of", "ffn_dim_multiplier", "rope_theta", "rope_scaling",
              "norm_eps", "tie_embeddings")


def _defaults() -> dict[str, object]:
    base = ModelConfig()
    return {f.name: getattr(base, f.name) for f in fields(ModelConfig)}


def _as_plain(value: object) -> object:
    """A nested config (dataclass or DictConfig) as a dict, for comparison with the default."""
    if hasattr(value, "items"):
        return dict(value.items())  # type: ignore[union-attr]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: getattr(value, f.name) for f in fields(value)}  # type: ignore[arg-type]
    return value


def model_problem(m: ModelConfig) -> str | None:
    """One line saying what is wrong with the model group (and how to fix it), or None."""
    if m.family not in FAMILIES:
        return f"model.family={m.family} is not a model family; choose one of {', '.join(FAMILIES)}"
    if m.n_embd % m.n_head != 0:
        return f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; pick n_embd as a multiple of n_head"
    if not 0.0 <= m.dropout < 1.0:
        return f"model.dropout={m.dropout} must be in [0, 1); set model.dropout=0.0"
    if m.family != "hf" and (m.path is not None or m.init != "auto"):
        return (f"model.path and model.init apply to model=hf but model={m.name} is perfrun's {m.family}; remove them, "
                "or use model=hf model.path=FOLDER (model.init_from=FOLDER starts perfrun's own families from a folder)")
    if m.family == "hf":
        return _hf_problem(m)
    if m.family == "custom":
        if not m.target:
            return ("model=custom needs model.target, the class of your model (pkg.module.ClassName or "
                    "path/to/file.py:ClassName), e.g. model.target=examples/seq_classifier.py:SeqClassifier")
        if m.init_from:
            return ("model.init_from loads a Hugging Face GPT-2 or Llama folder, not a custom model's weights; "
                    "remove it (load your weights in your class's __init__)")
        return None
    if m.target or m.args:
        return (f"model.target and model.args apply to model=custom but model={m.name} is perfrun's {m.family}; "
                "remove them, or add model=custom")
    if m.family == "gpt":
        defaults = _defaults()
        changed = [k for k in LLAMA_ONLY if _as_plain(getattr(m, k)) != _as_plain(defaults[k])]
        if changed:
            return (f"model.{changed[0]} applies to family=llama but model={m.name} is a GPT; remove it, "
                    "or use a Llama model (model=llama-tiny, or model.family=llama)")
        return None
    return _llama_problem(m)


def _hf_problem(m: ModelConfig) -> str | None:
    if not m.path:
        return "model=hf needs model.path, a Hugging Face model folder (config.json + model.safetensors); e.g. model.path=~/models/Qwen2.5-0.5B"
    if m.init not in HF_INITS:
        return f"model.init={m.init} is not an option; choose one of {', '.join(HF_INITS)}"
    if m.init_from:
        return f"model.init_from applies to perfrun's own families; with model=hf the weights come from model.path={m.path}: remove model.init_from"
    if m.target or m.args:
        return "model.target and model.args apply to model=custom; remove them (model=hf builds the folder's architecture)"
    return None


def _llama_problem(m: ModelConfig) -> str | None:
    s = m.rope_scaling
    scaling = RopeScalingConfig()
    for key, value, default in (("rope_theta", m.rope_theta, ModelConfig.rope_theta),
                                ("norm_eps", m.norm_eps, ModelConfig.norm_eps),
                                ("ffn_dim_multiplier", m.ffn_dim_multiplier, None),
                                ("rope_scaling.factor", s.factor, scaling.factor),
                                ("rope_scaling.low_freq_factor", s.low_freq_factor, scaling.low_freq_factor),
                                ("rope_scaling.high_freq_factor", s.high_freq_factor, scaling.high_freq_factor)):
        if value is not None and not math.isfinite(value):  # nan passes every comparison below
            return (f"model.{key}={value} must be a finite number; give the model's own value "
                    f"(its config.json has it), or model.{key}={'null' if default is None else default}, the default")
    kv = m.n_head if m.n_kv_head is None else m.n_kv_head
    if kv < 1 or m.n_head % kv != 0:
        return (f"model.n_head={m.n_head} is not divisible by model.n_kv_head={kv}; grouped-query attention shares "
                "each key/value head among n_head/n_kv_head query heads: pick n_kv_head dividing n_head")
    if (m.n_embd // m.n_head) % 2:
        return f"model.n_embd/n_head={m.n_embd // m.n_head} is odd; RoPE rotates pairs of dimensions: pick an even head size"
    if m.bias:
        return f"model.bias=true: model={m.name} is a Llama, which has no biases; set model.bias=false"
    if m.intermediate_size is not None and m.intermediate_size < 1:
        return f"model.intermediate_size={m.intermediate_size} must be >= 1, or null for Llama's rule"
    if m.multiple_of < 1 or (m.ffn_dim_multiplier is not None and m.ffn_dim_multiplier <= 0):
        return f"model.multiple_of={m.multiple_of} must be >= 1 and model.ffn_dim_multiplier > 0 (or null)"
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        return f"model.rope_theta={m.rope_theta} and model.norm_eps={m.norm_eps} must be > 0"
    if s.factor < 1 or s.original_max_position_embeddings < 1 or not 0 < s.low_freq_factor < s.high_freq_factor:
        return (f"model.rope_scaling (factor {s.factor}, low_freq_factor {s.low_freq_factor}, high_freq_factor "
                f"{s.high_freq_factor}, original_max_position_embeddings {s.original_max_position_embeddings}) needs "
                "factor >= 1 (1: no scaling) and 0 < low_freq_factor < high_freq_factor")
    return None
