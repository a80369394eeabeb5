"""perfrun's weights in Hugging Face's GPT-2 layout, as safetensors that
``transformers.GPT2LMHeadModel.from_pretrained`` loads.

GPT-2 in ``transformers`` keeps its projections in ``Conv1D``, which stores the weight as
(in, out), the transpose of ``nn.Linear``'s (out, in): c_attn, c_proj and c_fc weights are
transposed. ``lm_head`` is tied to ``wte`` and is not written (``tie_word_embeddings=true``),
as transformers itself saves it. A model trained with ``model.bias=false`` gets zero
biases, which compute the same. Each file is written whole or not at all
(:func:`perfrun.checkpoint.atomic.atomic_write`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from perfrun.checkpoint.atomic import atomic_write, write_json
from perfrun.config import ConfigError
from perfrun.models.gpt import GPT

CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


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


def export_safetensors(model: GPT, out: Path, vocab_size: int, meta: dict[str, str]) -> list[Path]:
    """Write ``out/model.safetensors`` and ``out/config.json`` (each atomically)."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise ConfigError("format=safetensors needs the safetensors package; pip install 'perfrun[export]'") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; format=safetensors writes a folder (model.safetensors + config.json)")
    files = [out / "model.safetensors", out / "config.json"]
    atomic_write(files[0], save(hf_state_dict(model), metadata={"format": "pt", **meta}))
    write_json(files[1], hf_config(model, vocab_size))
    return files
