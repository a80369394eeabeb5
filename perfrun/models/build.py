"""The model a run trains, built from its typed configuration: the family's module (GPT, Llama,
a Hugging Face folder's architecture for ``model=hf``, or the user's own class for ``model=custom``) with the vocabulary padded to a multiple of 64,
started from pretrained weights where model.init_from names a folder. Setup, the ladder's
look at what a model can take, the memory estimate and the benchmarks build through here."""

from __future__ import annotations

import torch
from torch import nn

from perfrun.config import ConfigError, ModelConfig
from perfrun.models.custom import build_custom
from perfrun.models.gpt import GPT, GPTConfig, padded_vocab
from perfrun.models.hf import build_hf
from perfrun.models.llama import Llama, LlamaConfig
from perfrun.models.pretrained import init_from


def build_module(m: ModelConfig, vocab_size: int, attention: str) -> nn.Module:
    """The configured module, freshly initialised on the current default device (``meta``:
    shapes only, to see what the model has before building it for real)."""
    if m.family == "custom":
        return build_custom(str(m.target), m.args)
    if m.family == "hf":  # the folder's shape and vocabulary; its weights where model.init says
        return build_hf(m, vocab_size, attention)
    if vocab_size < 2:
        raise ConfigError(f"model={m.name} needs the data's vocabulary size and the data gives none; "
                          "set data.vocab_size (or a vocab_size attribute on your dataset)")
    if m.family == "llama":
        return Llama(LlamaConfig.from_model(m, padded_vocab(vocab_size), attention))
    return GPT(GPTConfig(
        vocab_size=padded_vocab(vocab_size), block_size=m.block_size, n_layer=m.n_layer,
        n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, attention=attention,
    ))


def build_model(m: ModelConfig, vocab_size: int, attention: str) -> nn.Module:
    """The configured model on the CPU, in fp32, its weights initialised (or loaded)."""
    model = build_module(m, vocab_size, attention)
    return model if m.family in ("custom", "hf") else init_from(model, m, vocab_size)


def shape_only(m: ModelConfig, vocab_size: int, attention: str) -> nn.Module:
    """The model on the meta device: no memory, no initialisation cost, its attributes only."""
    with torch.device("meta"):
        return build_module(m, vocab_size, attention)
