"""perfrun's weights in Hugging Face's layouts, as safetensors that transformers loads:
GPT-2's (``GPT2LMHeadModel``) for GPT, Llama's (``LlamaForCausalLM``) for the Llama family.

Llama's weights are perfrun's under other names (perfrun/models/llama.py keeps
transformers' rotate-half RoPE and separate q/k/v projections), so both directions are a
renaming (:data:`LLAMA_NAMES`); a tied head is not written (``tie_word_embeddings``).

GPT-2 in ``transformers`` keeps its projections in ``Conv1D``, which stores the weight as
(in, out), the transpose of ``nn.Linear``'s (out, in): c_attn, c_proj and c_fc weights are
transposed. ``lm_head`` is tied to ``wte`` and is not written (``tie_word_embeddings=true``),
as transformers itself saves it. A model trained with ``model.bias=false`` gets zero
biases, which compute the same. Each file is written whole or not at all
(:func:`perfrun.checkpoint.atomic.atomic_write`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from perfrun.checkpoint.atomic import atomic_write, write_json
from perfrun.config import ConfigError
from perfrun.console import first_line
from perfrun.models.gpt import GPT
from perfrun.models.llama import Llama

CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

def folder_config(folder: Path, shown: str, *, wanted: str, no_config: str) -> Any:
    """A Hugging Face folder's config.json as plain JSON, or one line: the folder missing or a
    file (``wanted`` says what to give), no config.json (``no_config``), or JSON that does not parse."""
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file"
        raise ConfigError(f"{shown} {what}; give {wanted}")
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{shown} {no_config}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{shown}: config.json cannot be read as JSON ({first_line(e)}); the folder is damaged") from None



def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """perfrun's weights under GPT-2's names in transformers (Conv1D weights transposed,
    lm_head left out: it is tied to wte)."""
    c = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
    }

    def put(src: str, dst: str, *, transpose: bool = False, size: int | None = None) -> None:
        if src in sd:
            t = sd[src]
            out[dst] = t.t() if transpose else t
        else:  # model.bias=false: transformers always has biases; zeros compute the same
            out[dst] = torch.zeros(size or c.n_embd, dtype=sd["wte.weight"].dtype)

    for i in range(c.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            put(p + ln + ".weight", h + ln + ".weight")
            put(p + ln + ".bias", h + ln + ".bias")
        for name in CONV1D:
            w = sd[p + name + ".weight"]
            put(p + name + ".weight", h + name + ".weight", transpose=True)
            put(p + name + ".bias", h + name + ".bias", size=w.size(0))
    put("ln_f.weight", "transformer.ln_f.weight")
    put("ln_f.bias", "transformer.ln_f.bias")
    return {k: v.contiguous() for k, v in out.items()}


def perfrun_state_dict(hf: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_state_dict` (with lm_head re-tied to wte)."""
    sd = {"wte.weight": hf["transformer.wte.weight"], "wpe.weight": hf["transformer.wpe.weight"],
          "ln_f.weight": hf["transformer.ln_f.weight"], "ln_f.bias": hf["transformer.ln_f.bias"]}
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                sd[f"{p}{ln}.{kind}"] = hf[f"{h}{ln}.{kind}"]
        for name in CONV1D:
            sd[f"{p}{name}.weight"] = hf[f"{h}{name}.weight"].t().contiguous()
            sd[f"{p}{name}.bias"] = hf[f"{h}{name}.bias"]
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def hf_config(model: GPT, vocab_size: int) -> dict[str, Any]:
    """GPT2Config's fields for this model. GELU(tanh) is GPT-2's ``gelu_new``; LayerNorm's
    eps is torch's default 1e-5, as in GPT-2. Byte-level models have no BOS/EOS token."""
    c = model.config
    byte_level = vocab_size <= 256
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None if byte_level else 50256,
        "eos_token_id": None if byte_level else 50256,
        "torch_dtype": "float32",
        "perfrun_real_vocab_size": vocab_size,
    }


# perfrun's Llama names and transformers', one pair each; a slot ({n}: the layer, {qkvo} and
# {mlp}: the projection) is carried over, so the table reads both ways
_LLAMA_TEMPLATES = (
    ("wte.weight", "model.embed_tokens.weight"),
    ("blocks.{n}.attn_norm.weight", "model.layers.{n}.input_layernorm.weight"),
    ("blocks.{n}.attn.{qkvo}_proj.weight", "model.layers.{n}.self_attn.{qkvo}_proj.weight"),
    ("blocks.{n}.mlp_norm.weight", "model.layers.{n}.post_attention_layernorm.weight"),
    ("blocks.{n}.mlp.{mlp}_proj.weight", "model.layers.{n}.mlp.{mlp}_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
_SLOTS = {"{n}": r"(\d+)", "{qkvo}": "(q|k|v|o)", "{mlp}": "(gate|up|down)"}


def _direction(source: int) -> tuple[tuple[str, str], ...]:
    """(pattern, replacement) pairs from the templates' ``source`` side to the other."""
    pairs = []
    for templates in _LLAMA_TEMPLATES:
        pattern, replacement = re.escape(templates[source]), templates[1 - source]
        present = sorted((slot for slot in _SLOTS if slot in templates[source]), key=templates[source].find)
        for i, slot in enumerate(present, 1):  # groups numbered in the order the source names them
            pattern = pattern.replace(re.escape(slot), _SLOTS[slot])
            replacement = replacement.replace(slot, f"\\{i}")
        pairs.append((pattern, replacement))
    return tuple(pairs)


LLAMA_NAMES = _direction(0)  # perfrun's -> transformers'
HF_LLAMA_NAMES = _direction(1)  # transformers' -> perfrun's


def _rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    for pattern, replacement in pairs:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def llama_hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """perfrun's Llama weights under transformers' names (a tied lm_head left out)."""
    sd = model.state_dict()
    out = {str(_rename(k, LLAMA_NAMES)): v.detach().contiguous() for k, v in sd.items()}
    if model.config.tie_embeddings:
        del out["lm_head.weight"]
    return out


def llama_state_dict(hf: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """transformers' Llama weights under perfrun's names; a name perfrun has no place for is a
    KeyError (its caller says which). A tied head is the embedding."""
    sd: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer older transformers saved; perfrun derives it from the config
            continue
        ours = _rename(name, HF_LLAMA_NAMES)
        if ours is None:
            raise KeyError(name)
        sd[ours] = tensor
    if tied:
        sd.pop("lm_head.weight", None)
        sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def llama_hf_config(model: Llama, vocab_size: int) -> dict[str, Any]:
    """LlamaConfig's fields for this model. RoPE is written both ways: ``rope_parameters``
    (transformers 5) and ``rope_theta`` with ``rope_scaling`` (earlier versions)."""
    c = model.config
    s = c.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    scaling = None
    if s.factor != 1.0:
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
        rope.update(scaling)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim, "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "rope_parameters": rope, "rope_theta": c.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": c.tie_embeddings, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
        "perfrun_real_vocab_size": vocab_size,
    }


def export_safetensors(model: GPT | Llama, out: Path, vocab_size: int, meta: dict[str, str]) -> list[Path]:
    """Write ``out/model.safetensors`` and ``out/config.json`` (each atomically)."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise ConfigError("format=safetensors needs the safetensors package; pip install 'perfrun[export]'") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; format=safetensors writes a folder (model.safetensors + config.json)")
    files = [out / "model.safetensors", out / "config.json"]
    llama = isinstance(model, Llama)
    weights = llama_hf_state_dict(model) if llama else hf_state_dict(model)  # type: ignore[arg-type]
    atomic_write(files[0], save(weights, metadata={"format": "pt", **meta}))
    write_json(files[1], llama_hf_config(model, vocab_size) if llama else hf_config(model, vocab_size))  # type: ignore[arg-type]
    return files
