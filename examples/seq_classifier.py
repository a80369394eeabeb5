"""A model perfrun did not write: a small sequence classifier (not a decoder LM), and the
synthetic dataset it learns. Bring your own the same way:

    perfrun train model=custom model.target=examples/seq_classifier.py:SeqClassifier \\
        data=custom data.target=examples/seq_classifier.py:Sequences device=cpu

It has repeated ``blocks`` (so activation checkpointing, ``compile_options.scope=blocks`` and
FSDP2 apply) and no language-model head (so ``loss=chunked`` does not), and its attention is
its own (the ``attention`` knob does not act): perfrun says so at the start of the run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset


class Sequences(Dataset):
    """``n`` random token sequences; the label is how many of a sequence's tokens fall in the
    lower half of the vocabulary, in ``n_classes`` bands. Item i is a pure function of (seed, i)."""

    def __init__(self, n: int = 4096, seq_len: int = 64, vocab_size: int = 64, n_classes: int = 4,
                 seed: int = 0) -> None:
        self.n, self.seq_len, self.vocab_size, self.n_classes, self.seed = n, seq_len, vocab_size, n_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        low = torch.rand((), generator=g)  # each sequence its own share of low tokens
        tokens = torch.where(torch.rand(self.seq_len, generator=g) < low,
                             torch.randint(0, self.vocab_size // 2, (self.seq_len,), generator=g),
                             torch.randint(self.vocab_size // 2, self.vocab_size, (self.seq_len,), generator=g))
        share = (tokens < self.vocab_size // 2).float().mean()
        return tokens, (share * self.n_classes).long().clamp(max=self.n_classes - 1)


class Block(nn.Module):
    """Pre-norm encoder block: bidirectional attention and an MLP."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class SeqClassifier(nn.Module):
    """Tokens -> embeddings -> ``n_layer`` blocks -> mean over positions -> class logits."""

    def __init__(self, vocab_size: int = 64, n_classes: int = 4, dim: int = 64, n_layer: int = 2, n_head: int = 4,
                 max_len: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.norm, self.classify = nn.LayerNorm(dim), nn.Linear(dim, n_classes)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.classify(self.norm(x).mean(dim=1))
        return logits, None if targets is None else F.cross_entropy(logits, targets)
