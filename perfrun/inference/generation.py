"""The decode loop: prompts in, tokens out, timed.

**The static KV cache.** With ``cache=True`` the keys and values live in a
:class:`~perfrun.models.gpt.KVCache` that the model allocates once (``new_kv_cache``: GPT's keeps
n_head heads, Llama's only its n_kv_head) for ``batch`` sequences of ``capacity``
positions: the longest prompt plus ``max_new_tokens`` - 1, bounded by the model's
``block_size``. The prompt goes in one prefill; then each step feeds one token per
sequence through :meth:`~perfrun.models.gpt.GPT.decode_step`, which writes in place at each
sequence's own position and attends over the whole cache under a mask, so every step has
the same shapes. ``compile=True`` compiles that step (sampling included) with
``torch.compile``: ``mode="reduce-overhead"`` on CUDA (CUDA graphs), inductor's default
on the CPU; the prefill stays eager. Compilation and warm-up happen before the clock
starts and are reported apart (``warmup_s``).

**Beyond block_size.** The model sees at most ``block_size`` tokens (GPT's learned
positions, Llama's table of rotary angles). A longer prompt is cropped from the left. Once a sequence holds
more than ``block_size`` tokens, the uncached path conditions on its last ``block_size``
tokens, and the cached path does the same by re-filling the cache from that window at
each such step (counted as ``cache_refills``; each costs a full prefill, so the cache
speeds up only the steps within the window). The two paths stay token-for-token equal.

**Batches.** Prompts of different lengths sit right-padded in one batch: each sequence
keeps its own positions (padding is never attended to, and is overwritten by the
sequence's own tokens), so a prompt gives the same greedy tokens alone or in a batch.
Each sequence stops at ``max_new_tokens`` or at the tokenizer's end-of-text token; the
loop checks for the latter every :data:`STOP_CHECK` steps (one host sync), not per token.
Without streaming and without an end-of-text token the loop never waits on the device
until the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from perfrun.devices import synchronize
from perfrun.inference.sampling import UNIFORM_CHUNK, Sampler
from perfrun.models.gpt import GPT, KVCache
from perfrun.models.llama import Llama

STOP_CHECK = 32  # steps between the checks that every sequence has stopped (each one host sync)
WARMUP_STEPS = 3  # compiled: the first call compiles, CUDA graphs record on the next, replay after


@dataclass
class Generation:
    """Tokens out for each prompt and how long they took (wall clock, device synchronised)."""

    sequences: list[list[int]]  # per prompt, the generated tokens (an end-of-text token left out)
    stopped: list[bool]  # per prompt: ended on the end-of-text token rather than max_new_tokens
    seconds: float
    first_token_s: float  # prompt processing + first sample: what the user waits before text appears
    cache: bool
    cache_refills: int = 0
    prompt_lengths: tuple[int, ...] = ()  # tokens the model saw of each prompt (after cropping)
    cropped_by: tuple[int, ...] = ()  # prompt tokens dropped from the left to fit block_size
    warmup_s: float = 0.0  # the untimed warm-up (compilation included), 0 when there was none
    compiled: bool = False

    @property
    def tokens(self) -> list[int]:
        """The first (or only) sequence's tokens."""
        return self.sequences[0]

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_lengths[0]

    @property
    def cropped(self) -> int:
        return self.cropped_by[0]

    @property
    def total_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Steady-state rate after the first token (None when there is nothing after it)."""
        n = self.total_tokens - sum(1 for s in self.sequences if s)
        t = self.seconds - self.first_token_s
        return n / t if n > 0 and t > 0 else None


def cache_capacity(block_size: int, longest_prompt: int, max_new_tokens: int) -> int:
    """Positions the static cache needs: the prompt and every token fed back (the last
    sampled token is never fed), at most block_size."""
    return max(1, min(block_size, longest_prompt + max_new_tokens - 1))


class Generator:
    """A model, a sampler and (with the cache) a static KV cache for ``batch`` sequences,
    reused across calls of :meth:`run` so that a compiled step compiles once."""

    def __init__(self, model: GPT | Llama, sampler: Sampler, max_new_tokens: int, *, longest_prompt: int, batch: int = 1,
                 cache: bool = True, compile: bool = False, eot_id: int | None = None, warmup: bool = True) -> None:
        if compile and not cache:
            raise ValueError("compile=True compiles the cached decode step; it needs cache=True")
        self.model, self.sampler, self.max_new_tokens = model, sampler, max_new_tokens
        self.batch, self.cache, self.compiled, self.eot_id = batch, cache, compile, eot_id
        self.block = model.config.block_size
        self.device = next(model.parameters()).device
        self.kv: KVCache | None = None
        if cache:
            capacity = cache_capacity(self.block, min(longest_prompt, self.block), max_new_tokens)
            self.kv = model.new_kv_cache(batch, self.device, model.lm_head.weight.dtype, capacity)
        self.step: Callable[..., torch.Tensor] = self._decode
        if compile:
            self.step = self._compiled()
        self.pending_warmup = warmup

    # ------------------------------------------------------------------ the two kinds of forward

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """One token per sequence through the static cache, sampled: (B, 1) ids."""
        assert self.kv is not None
        return self.sampler.pick(self.model.decode_step(tok, pos, self.kv), u)

    def _compiled(self) -> Callable[..., torch.Tensor]:
        """The decode step under torch.compile. Dynamo keeps one cache per code object and
        falls back to eager after a few recompilations, and each Generator is a new ``self``
        to guard on: so the caches are reset first, and only the newest Generator's step is
        compiled (an older one's recompiles when called again)."""
        assert self.kv is not None
        torch.compiler.reset()
        for t in self.kv.k + self.kv.v:  # the cache is written in place: keep its addresses in the graph
            torch._dynamo.mark_static_address(t)
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        return torch.compile(self._decode, mode=mode, fullgraph=True, dynamic=False)

    def _context_logits(self, ctx: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits (B, V) after each sequence's last ``block_size`` tokens: the prefill (into
        the cache, from position 0) or, without the cache, the full forward."""
        width = min(max(lengths), self.block)
        starts = torch.tensor([max(0, n - self.block) for n in lengths], device=self.device)
        index = (starts.unsqueeze(1) + torch.arange(width, device=self.device)).clamp_(max=ctx.size(1) - 1)
        window = ctx.gather(1, index)
        last = torch.tensor([min(n, self.block) - 1 for n in lengths], device=self.device)
        if self.kv is not None:
            self.kv.length = 0
            return self.model.forward_cached(window, self.kv, last=last)
        with torch.no_grad():
            logits = self.model(window)[0]
        return logits[torch.arange(logits.size(0), device=self.device), last]

    # ------------------------------------------------------------------ the loop

    def _warm_up(self, ctx: torch.Tensor, lengths: list[int]) -> float:
        """Untimed: first-call allocations, kernel selection and compilation are not what
        the figures should measure. Draws no random numbers."""
        t0 = time.perf_counter()
        self._context_logits(ctx, lengths)
        if self.kv is not None:
            tok = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
            pos = torch.zeros(self.batch, dtype=torch.long, device=self.device)
            u = None if self.sampler.greedy else torch.full((self.batch, 1), 0.5, device=self.device)
            for _ in range(WARMUP_STEPS if self.compiled else 1):
                self._mark_step()
                self.step(tok, pos, u)
        synchronize(self.device)
        return time.perf_counter() - t0

    def _mark_step(self) -> None:
        if self.compiled and self.device.type == "cuda":  # a new CUDA-graph step: earlier outputs are copied out
            torch.compiler.cudagraph_mark_step_begin()

    def _prepare(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int], list[int]]:
        """The prompts cropped to block_size, padded to the batch (copies of the first), right-padded in one tensor."""
        if not 1 <= len(prompts) <= self.batch or not all(prompts):
            raise ValueError(f"run() takes 1 to {self.batch} non-empty prompts, got {[len(p) for p in prompts]}")
        cropped = [max(0, len(p) - self.block) for p in prompts]
        ids = [p[c:] for p, c in zip(prompts, cropped, strict=True)]
        ids += [ids[0]] * (self.batch - len(ids))
        lengths = [len(p) for p in ids]
        if self.kv is not None and self.kv.capacity < cache_capacity(self.block, max(lengths), self.max_new_tokens):
            raise ValueError(f"a prompt of {max(lengths)} tokens is longer than the longest_prompt this Generator's "
                             f"cache was made for ({self.kv.capacity} positions)")
        ctx = torch.zeros(self.batch, max(lengths) + self.max_new_tokens, dtype=torch.long)
        for row, p in enumerate(ids):
            ctx[row, : len(p)] = torch.tensor(p)
        return ctx.to(self.device), lengths, cropped

    @torch.no_grad()
    def run(self, prompts: list[list[int]], on_token: Callable[[int], None] | None = None) -> Generation:
        """Generate after each prompt; ``on_token`` (one prompt only) gets each token as it comes."""
        if on_token is not None and self.batch != 1:
            raise ValueError("on_token streams one sequence; use batch=1")
        ctx, lengths, cropped = self._prepare(prompts)
        warmup_s = self._warm_up(ctx, lengths) if self.pending_warmup else 0.0
        self.pending_warmup = False
        out, steps, refills, seconds, first = self._loop(ctx, lengths, len(prompts), on_token)
        rows = out[: len(prompts), :steps].tolist()
        stops = [r.index(self.eot_id) if self.eot_id in r else None for r in rows]
        return Generation(
            sequences=[r if s is None else r[:s] for r, s in zip(rows, stops, strict=True)],
            stopped=[s is not None for s in stops], seconds=seconds, first_token_s=first, cache=self.cache,
            cache_refills=refills, prompt_lengths=tuple(lengths[: len(prompts)]), cropped_by=tuple(cropped),
            warmup_s=warmup_s, compiled=self.compiled,
        )

    def _loop(self, ctx: torch.Tensor, lengths: list[int], rows: int,
              on_token: Callable[[int], None] | None) -> tuple[torch.Tensor, int, int, float, float]:
        """The timed part (``rows`` real sequences, the rest padding); returns (tokens (B, steps),
        steps, cache refills, seconds, first-token seconds)."""
        n_new, device = self.max_new_tokens, self.device
        out = torch.zeros(self.batch, n_new, dtype=torch.long, device=device)
        done = torch.arange(self.batch, device=device) >= rows  # padding never holds the loop up
        tok = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        pos = torch.tensor(lengths, device=device) - 1  # each sequence's last position
        lengths, refills, first, u = list(lengths), 0, 0.0, None
        t0 = time.perf_counter()
        nxt = tok
        for i in range(n_new):
            if i % UNIFORM_CHUNK == 0:
                u = self.sampler.uniforms(min(UNIFORM_CHUNK, n_new - i), self.batch, device)
            ui = None if u is None else u[i % UNIFORM_CHUNK]
            if i == 0 or self.kv is None or max(lengths) > self.kv.capacity:
                refills += int(i > 0 and self.kv is not None)
                nxt = self.sampler.pick(self._context_logits(ctx, lengths), ui)
            else:
                self._mark_step()
                nxt = self.step(tok, pos, ui)
            out[:, i] = nxt[:, 0]
            if i == 0:
                synchronize(device)
                first = time.perf_counter() - t0
            if self._stops(nxt, done, i, on_token):
                break
            ctx.scatter_(1, (pos + 1).unsqueeze(1), nxt)
            pos += 1
            lengths = [n + 1 for n in lengths]
            tok.copy_(nxt)
        synchronize(device)
        return out, i + 1, refills, time.perf_counter() - t0, first

    def _stops(self, nxt: torch.Tensor, done: torch.Tensor, i: int, on_token: Callable[[int], None] | None) -> bool:
        """Stream the token; True when every sequence has stopped (end-of-text), checked
        on the host per token only when streaming (which syncs anyway)."""
        if on_token is not None:
            token = int(nxt[0, 0])
            if token == self.eot_id:
                return True
            on_token(token)
            return False
        if self.eot_id is None:
            return False
        done |= nxt[:, 0] == self.eot_id
        return i % STOP_CHECK == STOP_CHECK - 1 and bool(done.all())


@torch.no_grad()
def generate(model: GPT | Llama, prompt: list[int], max_new_tokens: int, sampler: Sampler, *, cache: bool = True,
             on_token: Callable[[int], None] | None = None, warmup: bool = True, compile: bool = False,
             eot_id: int | None = None) -> Generation:
    """Sample up to ``max_new_tokens`` tokens after ``prompt`` (a batch of one)."""
    gen = Generator(model, sampler, max_new_tokens, longest_prompt=len(prompt), cache=cache, compile=compile,
                    eot_id=eot_id, warmup=warmup)
    return gen.run([prompt], on_token)
