"""The Llama family: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.

One file, read top to bottom as GPT's: the config, rotary embeddings (with Llama 3's
frequency scaling), attention, the MLP, the block, the model. The weights use the same
layout as Hugging Face's ``LlamaForCausalLM`` (rotary embedding on the two halves of each
head, separate q/k/v projections), so a folder written by ``save_pretrained`` loads by
renaming alone (perfrun/models/pretrained.py) and export is the reverse
(perfrun/models/hf_layout.py).

Grouped-query attention keeps ``n_kv_head`` key/value heads, each shared by
``n_head / n_kv_head`` query heads; the KV cache keeps only those. Before SDPA the keys and
values are repeated to ``n_head`` heads (as torchtitan does), which every SDPA kernel takes;
the projection weights and the cache stay small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from perfrun.model_schema import RopeScalingConfig
from perfrun.models.gpt import KVCache
from perfrun.models.losses import LossFn, standard_linear_cross_entropy


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: int | None = None  # None: n_head
    intermediate_size: int | None = None  # None: Llama's rule (:func:`swiglu_hidden`)
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    attention: str = "sdpa"  # sdpa | eager

    def __post_init__(self) -> None:
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        if self.intermediate_size is None:
            self.intermediate_size = swiglu_hidden(self.n_embd, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_model(cls, m: Any, vocab_size: int, attention: str = "sdpa") -> LlamaConfig:
        """From the ``model`` group (:class:`perfrun.model_schema.ModelConfig`)."""
        s = m.rope_scaling
        return cls(
            vocab_size=vocab_size, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
            n_kv_head=m.n_kv_head, intermediate_size=m.intermediate_size, multiple_of=m.multiple_of,
            ffn_dim_multiplier=m.ffn_dim_multiplier, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            rope_scaling=RopeScalingConfig(s.factor, s.low_freq_factor, s.high_freq_factor,
                                           s.original_max_position_embeddings),
            tie_embeddings=m.tie_embeddings, dropout=m.dropout, attention=attention,
        )


def swiglu_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's MLP width: 2/3 of 4 x dim (SwiGLU has three matrices, not two, for about the
    same parameters), scaled by ffn_dim_multiplier, rounded up to a multiple of multiple_of
    (Llama 3 8B: 4096, 1.3, 1024 -> 14336)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """The inverse frequencies (head_dim / 2,) of RoPE, with Llama 3's scaling: long
    wavelengths (beyond the original context / low_freq_factor) slowed by ``factor``, short
    ones (below the original context / high_freq_factor) kept, a smooth blend between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.factor == 1.0:
        return inv_freq
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def rope_cache(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (block_size, head_dim) of every position, each frequency written for both
    halves of the head (the rotate-half convention of Hugging Face's Llama weights)."""
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + head_dim/2]) by its position's angle."""
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.n_kv_head is not None
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.eager = cfg.attention == "eager"

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (B, n_head, T, hd) and k, v (B, n_kv_head, T, hd), q and k rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """Each key/value head repeated for the query heads that share it."""
        groups = self.n_head // self.n_kv_head
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        k, v = self._expand(k), self._expand(v)
        p = self.dropout if self.training else 0.0
        if self.eager:
            T = q.size(2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1), p, self.training)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self._out(y))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, start: int) -> torch.Tensor:
        """New tokens at positions ``start..start+T-1``: keys and values written into the cache,
        each query attending to every cached position up to its own (GPT's forward_cached)."""
        q, k, v = self._qkv(x, cos, sin)
        T, end = x.size(1), start + x.size(1)
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        keys, values = self._expand(k_cache[:, :, :end]), self._expand(v_cache[:, :, :end])
        if T == 1:
            y = F.scaled_dot_product_attention(q, keys, values)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            rows = torch.arange(start, end, device=x.device).unsqueeze(1)
            mask = torch.arange(end, device=x.device).unsqueeze(0) <= rows
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self._out(y)

    def forward_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One token per sequence at its own position ``pos`` (B,), scattered into the cache;
        attention over every slot under ``mask``: the same shapes at every step."""
        q, k, v = self._qkv(x, cos, sin)
        index = pos.view(-1, 1, 1, 1).expand(x.size(0), self.n_kv_head, 1, self.head_dim)
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
        y = F.scaled_dot_product_attention(q, self._expand(k_cache), self._expand(v_cache), attn_mask=mask)
        return self._out(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.intermediate_size is not None
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, start: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, k_cache, v_cache, start)
        return x + self.mlp(self.mlp_norm(x))

    def forward_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.forward_decode(self.attn_norm(x), cos, sin, k_cache, v_cache, pos, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.loss_fn: LossFn = standard_linear_cross_entropy  # the ``loss`` knob may swap in the chunked one
        cos, sin = rope_cache(cfg)  # fp32, computed once; not saved (they follow from the config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # RMSNorm weights stay at one
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; an untied token embedding (a lookup, not a matmul) is left out of the
        non-embedding count, a tied one counts as the head (as GPT's does)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding and not self.config.tie_embeddings else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N + 12*L*n_head*head_dim*T (GPT's formula). With GQA the
        score and value matmuls still run over every query head, so the attention term keeps
        n_head; the smaller k/v projections are in N."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * seq_len

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) without targets; (None, loss) with them, the loss taking the head's
        weight inside forward (DDP and FSDP2 see its use; the chunked loss never builds logits)."""
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.drop(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        hidden = self.norm(x)
        if targets is None:
            return self.lm_head(hidden), None
        return None, self.loss_fn(hidden, self.lm_head.weight, targets)

    def new_kv_cache(self, batch: int, device: torch.device | str, dtype: torch.dtype,
                     capacity: int | None = None) -> KVCache:
        """A static cache of ``capacity`` positions (at most block_size) with n_kv_head heads."""
        c = self.config
        capacity = c.block_size if capacity is None else capacity
        if not 1 <= capacity <= c.block_size:
            raise ValueError(f"KV cache capacity {capacity} must be in 1..block_size {c.block_size}")
        shape = (batch, c.n_kv_head, capacity, c.head_dim)
        return KVCache([torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.n_layer)],
                       [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.n_layer)])

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the new tokens ``idx`` (B, T) after the ``cache.length`` cached ones (the
        cache is extended in place); ``last`` (B,): only each row's logits at that index."""
        T, start = idx.size(1), cache.length
        if start + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {start} cached + {T} new > capacity {cache.capacity}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self.wte(idx)
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            x = block.forward_cached(x, cos, sin, k, v, start)
        cache.length = start + T
        if last is not None:
            x = x[torch.arange(x.size(0), device=x.device), last]
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def decode_step(self, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of one token per sequence, ``idx`` (B, 1) at positions ``pos`` (B,);
        the positions stay on the device and the shapes never change (a compiled step)."""
        B = idx.size(0)
        slots = torch.arange(cache.capacity, device=idx.device)
        mask = (slots <= pos.unsqueeze(1)).view(B, 1, 1, cache.capacity)
        cos, sin = self.rope_cos[pos].view(B, 1, 1, -1), self.rope_sin[pos].view(B, 1, 1, -1)
        x = self.wte(idx)
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            x = block.forward_decode(x, cos, sin, k, v, pos, mask)
        return self.lm_head(self.norm(x))[:, -1]
