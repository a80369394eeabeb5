"""The model a run trains, built from its typed configuration: the family's module with the
vocabulary padded to a multiple of 64, started from pretrained weights where model.init_from
names a folder. Setup, the memory estimate and the benchmarks build through this one function."""

from __future__ import annotations

from torch import nn

from perfrun.config import ModelConfig
from perfrun.models.gpt import GPT, GPTConfig, padded_vocab
from perfrun.models.llama import Llama, LlamaConfig
from perfrun.models.pretrained import init_from


def build_model(m: ModelConfig, vocab_size: int, attention: str) -> nn.Module:
    """The configured model on the CPU, in fp32, its weights initialised (or loaded)."""
    if m.family == "llama":
        return init_from(Llama(LlamaConfig.from_model(m, padded_vocab(vocab_size), attention)), m, vocab_size)
    config = GPTConfig(
        vocab_size=padded_vocab(vocab_size), block_size=m.block_size, n_layer=m.n_layer,
        n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, attention=attention,
    )
    return init_from(GPT(config), m, vocab_size)
