"""``model.init_from=PATH``: the weights of a Hugging Face GPT-2 or Llama folder start the run
(``model_type`` gpt2 for a GPT model group, llama for a Llama one).

The folder is what ``transformers``' ``save_pretrained`` writes and what ``perfrun export
format=safetensors`` writes: ``config.json`` with ``model.safetensors`` (or its shards and
``model.safetensors.index.json``), or ``pytorch_model.bin``, read with
``torch.load(weights_only=True)``: tensors and plain values only, no code runs. Nothing is
downloaded: point it at a folder you have.

The model's shape is checked against the model group, not taken from the folder: the model
group is where everything else reads the shape from (validation of ``data.seq_len``, the
FLOPs behind MFU, the automatic batch size, resume's checks, the configuration the run
records), so a folder of another shape is refused with one line that gives the overrides
(and the preset) that match it.

The vocabulary: the data's ids must be the checkpoint's (same size: same tokenizer, e.g.
``tiktoken:gpt2`` for GPT-2). perfrun pads the embedding to a multiple of 64 (50257 ->
50304); rows the checkpoint lacks start as the mean of its rows, so those never-seen ids
get an average logit and take a negligible share of the softmax, instead of the large one
that zero or random rows would have against GPT-2's trained logits.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from perfrun.checkpoint.safe_loading import load_pt
from perfrun.config import ConfigError, TrainConfig, config_dir
from perfrun.console import first_line, json_kinds
from perfrun.model_schema import ModelConfig
from perfrun.models.gpt import GPT
from perfrun.models.hf_layout import folder_config, llama_state_dict, perfrun_state_dict
from perfrun.models.llama import Llama

SHAPE = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "block_size": "n_positions"}
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # GELU with the tanh approximation, as perfrun's
BUFFER = re.compile(r"^h\.\d+\.attn\.(masked_)?bias$")  # transformers' causal-mask buffers, not weights
INSTALL_SAFETENSORS = "pip install safetensors (or 'perfrun[export]')"
# the model groups of a whole family rather than a preset: with model.init_from their shape is the folder's
FAMILY_GROUPS = ("llama",)

log = logging.getLogger("perfrun")


def config_json(folder: Path, shown: str, family: str = "gpt") -> dict[str, Any]:
    """config.json of a Hugging Face folder of the model group's family (model_type gpt2 or llama)."""
    arch = "GPT-2" if family == "gpt" else "Llama"
    config = folder_config(folder, shown, wanted=f"a Hugging Face {arch} folder (config.json + model.safetensors)",
                           no_config=f"is not a {arch} checkpoint folder: it has no config.json; give a folder written "
                                     "by save_pretrained or perfrun export format=safetensors")
    kind = config.get("model_type") if isinstance(config, dict) else None
    want = "gpt2" if family == "gpt" else "llama"
    if kind != want:
        other = "a Llama model group (model=llama-tiny, smollm2-135m, llama-3.2-1b, ...)" if kind == "llama" else (
            "a GPT model group (model=tiny, gpt2, ...)" if kind == "gpt2" else "a model perfrun has no family for")
        raise ConfigError(f"{shown} holds a model_type={kind} checkpoint, which needs {other}; model.family={family} "
                          f"takes {arch} folders (model_type {want})")
    check_field_types(config, folder / "config.json", family)
    return config


def read_config(folder: Path, shown: str) -> dict[str, Any]:
    """config.json of a GPT-2 folder, checked to describe perfrun's architecture."""
    config = config_json(folder, shown)
    act, eps, inner = config.get("activation_function", "gelu_new"), config.get("layer_norm_epsilon", 1e-5), config.get("n_inner")
    if act not in ACTIVATIONS or abs(float(eps) - 1e-5) > 1e-12 or inner not in (None, 4 * int(config.get("n_embd", 0))):
        raise ConfigError(f"{shown} is a GPT-2 variant (activation {act}, layer_norm_epsilon {eps}, n_inner {inner}) that "
                          "perfrun's GPT does not compute (gelu_new, 1e-05, 4 x n_embd)")
    return config


# config.json fields perfrun reads, by family, and the types each may have (None: may be null)
FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "gpt": {
        "n_layer": (int,), "n_head": (int,), "n_embd": (int,), "n_positions": (int,), "n_ctx": (int,),
        "vocab_size": (int,), "n_inner": (int, type(None)), "perfrun_real_vocab_size": (int, type(None)),
        "layer_norm_epsilon": (int, float), "activation_function": (str,),
    },
    "llama": {
        "hidden_size": (int,), "intermediate_size": (int,), "num_hidden_layers": (int,), "num_attention_heads": (int,),
        "num_key_value_heads": (int, type(None)), "head_dim": (int, type(None)), "max_position_embeddings": (int,),
        "vocab_size": (int,), "perfrun_real_vocab_size": (int, type(None)), "rope_theta": (int, float),
        "rms_norm_eps": (int, float), "tie_word_embeddings": (bool,), "attention_bias": (bool,), "mlp_bias": (bool,),
        "hidden_act": (str,), "rope_scaling": (dict, type(None)), "rope_parameters": (dict, type(None)),
    },
}
# the fields of Llama's RoPE object (``rope_scaling``, or transformers 5's ``rope_parameters``)
ROPE_TYPES: dict[str, tuple[type, ...]] = {
    "rope_theta": (int, float), "factor": (int, float), "low_freq_factor": (int, float),
    "high_freq_factor": (int, float), "original_max_position_embeddings": (int,), "rope_type": (str,), "type": (str,),
}
# the fields a config.json of the family must have: the shape is read from them, with no default
REQUIRED = {"gpt": ("n_layer", "n_head", "n_embd"),
            "llama": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}


def check_field_types(config: dict[str, Any], file: Path, family: str = "gpt") -> None:
    """Each field perfrun reads has its JSON type (a whole number is no string or bool, a number
    is finite), and the shape's fields are there: otherwise one line naming the file, the field
    and its value."""
    for key in REQUIRED[family]:
        if key not in config:
            raise ConfigError(f"{file}: field {key} is missing, and the model's shape is read from it; add it to that "
                              "file (or export the model again)")
    if family == "gpt" and "n_positions" not in config and "n_ctx" not in config:
        raise ConfigError(f"{file}: field n_positions (or n_ctx) is missing, and the model's context is read from it; "
                          "add it to that file (or export the model again)")
    fields = [(key, config[key], types) for key, types in FIELD_TYPES[family].items() if key in config]
    if family == "llama":
        fields += [(f"{outer}.{key}", config[outer][key], types) for outer in ("rope_scaling", "rope_parameters")
                   if isinstance(config.get(outer), dict) for key, types in ROPE_TYPES.items() if key in config[outer]]
    for key, value, types in fields:
        wrong = (isinstance(value, bool) and bool not in types) or not isinstance(value, types) or (
            isinstance(value, float) and not math.isfinite(value))
        if wrong:
            raise ConfigError(f"{file}: field {key} is {json.dumps(value)}, not {json_kinds(types)}; correct it in that file "
                              "(or export the model again)")


def _preset(shape: dict[str, Any]) -> str | None:
    """The model group's preset with this shape (dotted keys, the schema's defaults filling
    what a preset leaves out), if there is one."""
    for path in sorted(Path(config_dir(), "model").glob("*.yaml")):
        preset = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
        if all(OmegaConf.select(preset, k) == v for k, v in shape.items()):
            return path.stem
    return None


def check_shape(config: dict[str, Any], model: GPT, model_cfg: ModelConfig, shown: str) -> None:
    """The folder's shape must be the model group's; else one line with the overrides."""
    theirs = {ours: int(config.get(key, config.get("n_ctx", 0) if key == "n_positions" else 0))
              for ours, key in SHAPE.items()}
    mine = {k: int(getattr(model.config, k)) for k in SHAPE}
    if theirs == mine:
        return
    preset = _preset({"family": "gpt", **theirs})
    overrides = " ".join(f"model.{k}={v}" for k, v in theirs.items())
    raise ConfigError(
        f"{shown} is a GPT-2 of {', '.join(f'{k} {v}' for k, v in theirs.items())} but model={model_cfg.name} has "
        f"{', '.join(f'{k} {v}' for k, v in mine.items())}; use "
        + (f"model={preset} (or {overrides})" if preset else overrides)
    )


def read_weights(folder: Path, shown: str, arch: str = "GPT-2") -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors (or its shards) or pytorch_model.bin, on the CPU."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    try:
        if single.is_file() or index.is_file():
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise ConfigError(f"{shown}: reading model.safetensors needs safetensors; {INSTALL_SAFETENSORS}") from None
            files = ([single] if single.is_file() else
                     sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()}))
            weights: dict[str, torch.Tensor] = {}
            for f in files:
                weights.update(load_file(str(f)))
            return weights
        legacy = folder / "pytorch_model.bin"
        if legacy.is_file():
            loaded = load_pt(legacy)  # a plain pickle: one line, "pickled code"
            if not isinstance(loaded, dict):
                raise ConfigError(f"{shown}: pytorch_model.bin holds a {type(loaded).__name__}, not a state dict of tensors")
            return loaded
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, torch.load and json each raise their own kinds
        raise ConfigError(f"{shown}: its weights cannot be read ({first_line(e)}); the file is damaged or not "
                          f"a {arch} checkpoint") from None
    raise ConfigError(f"{shown} is not a {arch} checkpoint folder: it has config.json but no model.safetensors or "
                      "pytorch_model.bin")


def _perfrun_names(hf: dict[str, torch.Tensor], n_layer: int, shown: str) -> dict[str, torch.Tensor]:
    """transformers' names (with or without the ``transformer.`` prefix) as perfrun's."""
    bare = {k.removeprefix("transformer."): v for k, v in hf.items()}
    head = bare.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, bare.get("wte.weight", head)):
        raise ConfigError(f"{shown}: its output layer (lm_head) is not tied to its embedding (wte); perfrun's GPT "
                          "ties them, as GPT-2 does")
    prefixed = {f"transformer.{k}": v for k, v in bare.items() if not BUFFER.match(k)}
    try:
        return perfrun_state_dict(prefixed, n_layer)
    except KeyError as e:
        raise ConfigError(f"{shown}: its weights have no tensor {e.args[0].removeprefix('transformer.')}; it is not a "
                          "GPT-2 checkpoint of the shape its config.json gives") from None


def _pad_rows(t: torch.Tensor, rows: int, real: int) -> torch.Tensor:
    """``rows`` rows of ``t``: padding rows beyond dropped, missing ones the mean of the real ones."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t[:real].float().mean(0, keepdim=True).to(t.dtype).expand(rows - t.shape[0], -1)])


def _fit_vocab(sd: dict[str, torch.Tensor], rows: int, real: int, data_vocab: int, shown: str,
               tied: bool = True) -> None:
    """Give the embedding (and an untied head) the model's (padded) number of rows: drop
    padding rows beyond it, add rows that start as the mean of the checkpoint's real ones."""
    if data_vocab != real:
        raise ConfigError(
            f"{shown} was trained on a vocabulary of {real} token ids but the data has {data_vocab}, so its ids are "
            "another tokenizer's; prepare the data with the checkpoint's tokenizer (GPT-2: perfrun prepare "
            "tokenizer=tiktoken:gpt2), or set data.vocab_size if the ids are the checkpoint's"
        )
    sd["wte.weight"] = _pad_rows(sd["wte.weight"], rows, real)
    sd["lm_head.weight"] = sd["wte.weight"] if tied else _pad_rows(sd["lm_head.weight"], rows, real)


def llama_shape(config: dict[str, Any], shown: str) -> dict[str, Any]:
    """A Llama config.json as the model group's keys (dotted), checked to be what perfrun's
    Llama computes. RoPE: ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier versions)."""
    rope = config.get("rope_parameters") or {}
    scaling = rope if "factor" in rope else (config.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    hidden, heads = int(config.get("hidden_size", 0)), int(config.get("num_attention_heads", 1))
    act, head_dim = config.get("hidden_act", "silu"), config.get("head_dim") or hidden // max(heads, 1)
    biased = bool(config.get("attention_bias")) or bool(config.get("mlp_bias"))
    if kind not in ("default", "llama3") or act != "silu" or biased or head_dim * heads != hidden:
        raise ConfigError(f"{shown} is a Llama variant (rope_type {kind}, hidden_act {act}, biases {biased}, head_dim "
                          f"{head_dim}) that perfrun's Llama does not compute (default or llama3 RoPE, silu, no "
                          "biases, head_dim = hidden_size / num_attention_heads)")
    shape: dict[str, Any] = {
        "n_layer": int(config.get("num_hidden_layers", 0)), "n_embd": hidden, "n_head": heads,
        "n_kv_head": int(config.get("num_key_value_heads") or heads),
        "intermediate_size": int(config.get("intermediate_size", 0)),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_scaling.factor": float(scaling.get("factor", 1.0)) if kind == "llama3" else 1.0,
    }
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            shape[f"rope_scaling.{key}"] = float(scaling[key])
        shape["rope_scaling.original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return shape


def check_llama_shape(config: dict[str, Any], model: Llama, model_cfg: ModelConfig, shown: str) -> None:
    """The folder's Llama must be the model group's, and its context at least block_size;
    else one line with the overrides (and the preset) that match it."""
    theirs = llama_shape(config, shown)
    c = model.config
    mine = {k: getattr(c.rope_scaling, k.split(".")[1]) if k.startswith("rope_scaling.") else getattr(c, k)
            for k in theirs}
    context = int(config.get("max_position_embeddings", c.block_size))
    if theirs == mine and c.block_size <= context:
        return
    differ = [f"{k} {theirs[k]} (here {mine[k]})" for k in theirs if theirs[k] != mine[k]]
    preset = _preset({"family": "llama", **theirs})
    overrides = " ".join(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in theirs.items())
    if c.block_size > context:
        differ.append(f"max_position_embeddings {context} (here block_size {c.block_size})")
        overrides += f" model.block_size={context}"
    raise ConfigError(f"{shown} is a Llama of another shape than model={model_cfg.name}: {', '.join(differ)}; use "
                      + (f"model={preset} (or {overrides})" if preset else overrides)
                      + ", or model=llama, which takes the folder's shape from its config.json")


def _init_llama(model: Llama, model_cfg: ModelConfig, data_vocab: int, folder: Path, shown: str) -> Llama:
    config = config_json(folder, shown, "llama")
    check_llama_shape(config, model, model_cfg, shown)
    try:
        sd = llama_state_dict(read_weights(folder, shown, "Llama"), model.config.tie_embeddings)
    except KeyError as e:
        raise ConfigError(f"{shown}: its weights hold {e.args[0]}, which perfrun's Llama has no place for; it is "
                          "not a Llama checkpoint of the shape its config.json gives") from None
    if "wte.weight" not in sd or "lm_head.weight" not in sd:
        raise ConfigError(f"{shown}: its weights have no embed_tokens or lm_head; the folder is damaged")
    real = int(config.get("perfrun_real_vocab_size") or config.get("vocab_size") or sd["wte.weight"].shape[0])
    _fit_vocab(sd, model.config.vocab_size, real, data_vocab, shown, tied=model.config.tie_embeddings)
    _load(model, sd, shown)
    return model


def _load(model: torch.nn.Module, sd: dict[str, torch.Tensor], shown: str) -> None:
    """The weights into ``model``; a folder whose weights hold NaN or infinity (a diverged run
    exported) is refused naming the folder and the tensor, before a step could blame the
    learning rate for it."""
    for name, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(f"{shown}: its weight {name} holds {bad:,} NaN or infinite values, so training from it "
                              "can only give NaN; give a folder of finite weights (one saved before the run diverged)")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"{shown}: its weights do not fit its config.json ({first_line(e, 120)}); the folder is "
                          "damaged or hand-edited") from None


def init_from(model: GPT | Llama, model_cfg: ModelConfig, data_vocab: int) -> GPT | Llama:
    """``model`` with the weights of ``model_cfg.init_from`` (unchanged when it is not set);
    anything that does not fit is a one-line ConfigError."""
    if not getattr(model_cfg, "init_from", None):
        return model
    folder = Path(str(model_cfg.init_from)).expanduser()
    shown = f"model.init_from={model_cfg.init_from}"
    if isinstance(model, Llama):
        return _init_llama(model, model_cfg, data_vocab, folder, shown)
    config = read_config(folder, shown)
    check_shape(config, model, model_cfg, shown)
    sd = _perfrun_names(read_weights(folder, shown), model.config.n_layer, shown)
    real = int(config.get("perfrun_real_vocab_size") or config.get("vocab_size") or sd["wte.weight"].shape[0])
    _fit_vocab(sd, model.config.vocab_size, real, data_vocab, shown)
    expected = model.state_dict()
    for key in sorted(set(sd) - set(expected)):  # model.bias=false: the checkpoint's biases must be zero
        if not key.endswith(".bias") or sd[key].any():
            raise ConfigError(f"{shown} has a non-zero {key} that model.bias=false leaves out; set model.bias=true")
        del sd[key]
    _load(model, sd, shown)
    return model


def with_folder_shape(cfg: TrainConfig) -> TrainConfig:
    """``model=llama model.init_from=FOLDER``: the job's configuration with the folder's shape
    (config.json, as from_pretrained reads it) in the model group, logged, so that everything
    reading the shape (validation, FLOPs, the estimate, the recorded configuration, resume)
    reads the folder's. A preset keeps its own shape, which the folder must match."""
    m = cfg.model
    if m.name not in FAMILY_GROUPS or not m.init_from:
        return cfg
    folder = Path(str(m.init_from)).expanduser()
    shown = f"model.init_from={m.init_from}"
    shape = llama_shape(config_json(folder, shown, "llama"), shown)
    nested: dict[str, Any] = {}
    for key, value in shape.items():
        group, _, leaf = key.rpartition(".")
        (nested.setdefault(group, {}) if group else nested)[leaf] = value
    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(m), nested))
    log.info(f"model=llama: the shape of {folder / 'config.json'}: "
             + ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items()))
    return replace(cfg, model=merged)
