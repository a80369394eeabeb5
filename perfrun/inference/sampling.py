"""Sampling the next token: greedy, temperature, top-k, by inverse CDF.

The random numbers come from a seeded CPU generator, one uniform per sequence per token,
drawn in that order whatever the device, the path (cached, uncached, compiled) or how
many steps are drawn at once. So a fixed seed gives the same tokens with and without the
KV cache, compiled or not (and on CPU and CUDA, up to float noise); ``torch.multinomial``
would draw on the device, in a device-dependent way. The generation loop draws the
uniforms for many steps at once and copies them to the device in one transfer, so
sampling needs no host round trip per token and can run inside a compiled graph.
"""

from __future__ import annotations

import torch

UNIFORM_CHUNK = 256  # steps of uniforms drawn and copied to the device at once


class Sampler:
    """Temperature and top-k sampling over the model's real vocabulary (the padded ids
    above ``vocab_size`` are never sampled); ``temperature=0`` is greedy."""

    def __init__(self, temperature: float, top_k: int | None, vocab_size: int, seed: int) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def uniforms(self, steps: int, batch: int, device: torch.device) -> torch.Tensor | None:
        """The next ``steps`` x ``batch`` uniforms (steps, batch, 1), on ``device``; None when greedy."""
        if self.greedy:
            return None
        return torch.rand(steps, batch, 1, generator=self.gen).to(device)

    def pick(self, logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """(B, V_padded) logits of the last position and (B, 1) uniforms -> (B, 1) token ids;
        pure tensor work (no host sync), so it can sit inside a compiled decode step."""
        logits = logits[:, : self.vocab_size].float()
        if u is None:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
        # right=True: the first token whose cumulative probability exceeds u (never a zero-probability one)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return idx.clamp_(max=logits.size(-1) - 1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One step: draw this step's uniforms and pick (B, 1) token ids."""
        u = self.uniforms(1, logits.size(0), logits.device)
        return self.pick(logits, None if u is None else u[0])
