"""GPT-2's architecture: pre-norm blocks, learned positions, GELU MLP, tied embeddings.

Attention goes through ``scaled_dot_product_attention`` with ``is_causal=True`` (no mask
tensor, so the flash and memory-efficient kernels apply); ``attention="eager"`` computes
softmax over a causal mask built once, for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from perfrun.models.losses import LossFn, standard_linear_cross_entropy


@dataclass
class GPTConfig:
    vocab_size: int = 256  # padded to a multiple of 64 by :func:`padded_vocab`
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # sdpa | eager


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up: matmuls on a multiple of 64 run faster (50257 -> 50304)."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, per layer, preallocated and written in place.

    Inference only (generation): the training forward never takes a cache, so its numerics
    are untouched. ``capacity`` (at most block_size: positions are learned and absolute) is
    the number of positions allocated, for the prompt plus the tokens to generate, so the
    tensors never grow. :meth:`GPT.forward_cached` fills positions ``length, length + 1,
    ...``; :meth:`GPT.decode_step` writes one token per sequence at the positions it is
    given and attends over all ``capacity`` slots under a mask, so every decode step has
    the same shapes (what a compiled step or a CUDA graph needs).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: GPTConfig, batch: int, device: torch.device | str, dtype: torch.dtype,
              capacity: int | None = None) -> KVCache:
        capacity = cfg.block_size if capacity is None else capacity
        if not 1 <= capacity <= cfg.block_size:
            raise ValueError(f"KV cache capacity {capacity} must be in 1..block_size {cfg.block_size}")
        shape = (batch, cfg.n_head, capacity, cfg.n_embd // cfg.n_head)
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)])

    @property
    def capacity(self) -> int:
        return self.k[0].size(2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.eager = cfg.attention == "eager"
        if self.eager:
            # Built once; sliced to the sequence length on each call.
            mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
            self.register_buffer("causal_mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)
            self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.eager:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def forward_cached(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
        """Attention for new tokens at positions ``start..start+T-1``: their keys and values
        are written into the cache, and each query attends to every cached position up to
        its own (the causal rule of :meth:`forward`, over a longer key sequence)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        end = start + T
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
        if T == 1:  # one new token sees everything cached: no mask at all
            y = F.scaled_dot_product_attention(q, keys, values)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            rows = torch.arange(start, end, device=x.device).unsqueeze(1)
            mask = torch.arange(end, device=x.device).unsqueeze(0) <= rows
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward_decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """One new token per sequence (x: B, 1, C) at its own position ``pos`` (B,): its key
        and value are scattered into the cache in place, and the query attends over every
        slot under ``mask`` (B, 1, 1, capacity), so the shapes never depend on the step."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        index = pos.view(B, 1, 1, 1).expand(B, self.n_head, 1, C // self.n_head)
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward_cached(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln_1(x), k_cache, v_cache, start)
        return x + self.mlp(self.ln_2(x))

    def forward_decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.forward_decode(self.ln_1(x), k_cache, v_cache, pos, mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        # (hidden, head weight, targets) -> mean loss: the ``loss`` knob may swap in the chunked one
        self.loss_fn: LossFn = standard_linear_cross_entropy
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; the position embedding is left out of the non-embedding count
        (the token embedding is tied to the head, so it counts, as in nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B, as nanoGPT uses).

        N: non-embedding parameters; forward + backward of each weight costs 6 FLOPs per
        token; attention's score and value matmuls add 12 * layers * heads * head_dim * T.
        Activation recomputation (checkpointing) is not counted: this is model FLOPs.
        """
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * seq_len

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) without targets; (None, loss) with them: the loss function takes the
        head's (tied) weight here, inside forward, so DDP and FSDP2 see its use and its
        gradient, and the chunked loss never materialises the logits."""
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        if targets is None:
            return self.lm_head(hidden), None
        return None, self.loss_fn(hidden, self.lm_head.weight, targets)

    def new_kv_cache(self, batch: int, device: torch.device | str, dtype: torch.dtype,
                     capacity: int | None = None) -> KVCache:
        """A static cache of ``capacity`` positions (at most block_size) for generation."""
        return KVCache.empty(self.config, batch, device, dtype, capacity)

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the new tokens ``idx`` (B, T), which follow the ``cache.length`` tokens
        already in ``cache``; the cache is extended in place. Inference only (no dropout,
        no loss): generation feeds the prompt once (the prefill), then one token per step.
        ``last`` (B,): only each row's logits at that index, (B, V), and the head is not
        computed for the other positions."""
        T = idx.size(1)
        start = cache.length
        if start + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {start} cached + {T} new > capacity {cache.capacity}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            x = block.forward_cached(x, k, v, start)
        cache.length = start + T
        if last is not None:
            x = x[torch.arange(x.size(0), device=x.device), last]
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def decode_step(self, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of one new token per sequence, ``idx`` (B, 1) at positions ``pos``
        (B,) (each sequence its own: prompts of other lengths). Positions stay on the device,
        so stepping needs no host sync and the shapes are the same at every step."""
        slots = torch.arange(cache.capacity, device=idx.device)
        mask = (slots <= pos.unsqueeze(1)).view(idx.size(0), 1, 1, cache.capacity)
        x = self.wte(idx) + self.wpe(pos).unsqueeze(1)
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            x = block.forward_decode(x, k, v, pos, mask)
        return self.lm_head(self.ln_f(x))[:, -1]
