"""``perfrun generate``: sample text from a checkpoint, with or without a KV cache, timed.

A Hydra app over :class:`GenerateConfig` (``perfrun generate --help`` lists every key).
The work is done by :mod:`perfrun.inference`; this module reads the configuration and
the prompts, prints the text and the measurements. The generated text goes to stdout
(as it comes with ``stream``); the measurements go to stderr, so ``perfrun generate ...
> out.txt`` keeps only the text. With ``prompts_file=`` each prompt's result is one JSON
object per line on stdout, in the file's order.

The cache's gain is measured, not claimed: ``cache=false`` (or ``--no-cache``) runs the
same sampler over the full context at every step, and for a fixed seed both paths (and
the compiled one) give the same tokens (see :mod:`perfrun.inference.sampling`).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from perfrun.commands.hydra_app import HydraCommand
from perfrun.config import ConfigError
from perfrun.console import error, stderr_console
from perfrun.data.tokenizers import Tokenizer
from perfrun.devices import resolve_device
from perfrun.inference.generation import Generation, Generator
from perfrun.inference.loading import Loaded, load_model
from perfrun.inference.sampling import Sampler
from perfrun.models import contract

MAX_NEW_TOKENS = 100_000  # past block_size each token costs a full forward over block_size tokens
CACHE_HELP = ("the static KV cache, preallocated for the longest prompt + max_new_tokens and at most block_size "
              "positions; cache=false (or --no-cache) recomputes the whole context for each token, for comparison. "
              "A prompt longer than block_size is cropped from the left; once a sequence passes block_size the model "
              "sees only its last block_size tokens, and the cache is re-filled from them at every further token "
              "(a full prefill per token, as slow as cache=false)")


@dataclass
class GenerateConfig:
    """What one ``perfrun generate`` asks for; :meth:`validate` checks what the types cannot."""

    checkpoint: str | None = field(default=None, metadata={
        "help": "a step_*.pt file, a sharded step_* folder, or a run folder (its newest checkpoint); required"})
    prompt: str | None = field(default=None, metadata={
        "help": "the text to continue, taken literally (quote it for the shell only); null: a newline"})
    prompts_file: str | None = field(default=None, metadata={
        "help": "a UTF-8 file of prompts, one per line, generated in batches; prints one JSON object per prompt"})
    batch_size: int = field(default=8, metadata={"help": "prompts of prompts_file generated together"})
    max_new_tokens: int = field(default=200, metadata={
        "help": f"tokens to generate per prompt, 1 to {MAX_NEW_TOKENS}; a sequence stops earlier at its "
                "tokenizer's end-of-text token (byte-level models have none)"})
    temperature: float = field(default=0.8, metadata={"help": "0 is greedy; higher flattens the distribution"})
    top_k: int | None = field(default=None, metadata={
        "help": "sample among the k most likely tokens only; null (or none): all"})
    seed: int = field(default=1337, metadata={
        "help": "the sampler's seed: one seed gives the same tokens cached, uncached and compiled"})
    cache: bool = field(default=True, metadata={"help": CACHE_HELP})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile the decode step (mode=reduce-overhead with CUDA graphs on CUDA; inductor on the "
                "CPU, which needs a C++ compiler); the prefill stays eager; compile and warm-up time is reported "
                "apart from tokens/s"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    quantize: str = field(default="none", metadata={
        "help": "none, or int8: dynamic int8 Linear layers via torchao (CPU only)"})
    stream: bool | None = field(default=None, metadata={
        "help": "print tokens as they come (one prompt; each token then waits for the device); "
                "null: on for prompt=, off for prompts_file="})

    def validate(self) -> None:
        if not self.checkpoint:
            raise ConfigError("checkpoint=PATH is required (a step_*.pt file or a run folder); "
                              "perfrun generate --help lists the keys")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1 and at most {MAX_NEW_TOKENS} "
                              "(past block_size each token costs a full forward); e.g. max_new_tokens=200")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ConfigError(f"temperature={self.temperature} must be a finite number >= 0; "
                              "temperature=0 is greedy, 0.8 a usual choice")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be >= 1; give top_k=none to sample from every token")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be >= 1; e.g. batch_size=8")
        try:
            torch.Generator().manual_seed(self.seed)
        except (RuntimeError, ValueError):
            raise ConfigError(f"seed={self.seed} is outside what the random number generator takes "
                              f"({-2**63} to {2**64 - 1}); choose e.g. seed=1337") from None
        if self.quantize not in ("none", "int8"):
            raise ConfigError(f"quantize={self.quantize} is not an option; choose none or int8")
        if self.quantize == "int8" and self.device.startswith("cuda"):
            raise ConfigError("quantize=int8 is dynamic int8 for CPU inference; use device=cpu (or auto) with it")
        self._validate_modes()
        if self.prompt is not None:
            check_prompt(self.prompt, "prompt")

    def _validate_modes(self) -> None:
        if self.compile and not self.cache:
            raise ConfigError("compile=true compiles the cached decode step; drop cache=false (or --no-cache)")
        if self.compile and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")) \
                and resolve_device(self.device).type == "cpu":
            raise ConfigError("compile=true on the CPU needs a C++ compiler (inductor builds C++ kernels) and none "
                              "is on PATH; install one (apt-get install g++) or set compile=false")
        if self.prompts_file is not None and self.prompt is not None:
            raise ConfigError("give prompt= or prompts_file=, not both")
        if self.prompts_file is not None and self.stream:
            raise ConfigError("stream=true prints one prompt's text as it comes; prompts_file= prints one JSON "
                              "line per prompt when its batch is done: drop stream=true")

    def prompts(self) -> list[str]:
        """The prompt, or the file's prompts (checked: readable, UTF-8, no empty line)."""
        if self.prompts_file is None:
            return ["\n" if self.prompt is None else self.prompt]
        return read_prompts(Path(self.prompts_file).expanduser())


def check_prompt(text: str, where: str) -> None:
    if not text:
        raise ConfigError(f"{where} is empty and byte-level models have no start token; give prompt=\"some text\"")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where} holds bytes that are not valid UTF-8 (at character {e.start}); "
                          "give the prompt as UTF-8 text") from None


def read_prompts(path: Path) -> list[str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"prompts_file={path}: {e.strerror or e}; give a text file with one prompt per line") from None
    prompts = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"prompts_file={path} line {n} is not valid UTF-8 (byte {line[e.start]:#04x} at "
                              f"column {e.start + 1}); save the file as UTF-8") from None
        check_prompt(text, f"prompts_file={path} line {n}")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"prompts_file={path} holds no prompt; write one prompt per line")
    return prompts


class Streamer:
    """Writes tokens as text as they come. Text is printed up to the last complete
    character (a byte-level or BPE token can end inside a multi-byte character; a U+FFFD
    at the end is held back until the next token completes or replaces it)."""

    def __init__(self, tokenizer: Tokenizer, stream: Any = None) -> None:
        self.tokenizer = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.pending: list[int] = []

    def __call__(self, token: int) -> None:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if not text.endswith("\ufffd"):
            self.stream.write(text)
            self.stream.flush()
            self.pending = []

    def close(self) -> None:
        self.stream.write(self.tokenizer.decode(self.pending) + "\n")
        self.stream.flush()


def _load(cfg: GenerateConfig) -> tuple[Loaded, Tokenizer, list[str], torch.device]:
    cfg.validate()
    texts = cfg.prompts()
    device = torch.device("cpu") if cfg.quantize == "int8" else resolve_device(cfg.device)
    loaded = load_model(Path(cfg.checkpoint or "").expanduser(), device)
    return loaded, loaded.tokenizer(), texts, device


def _header(cfg: GenerateConfig, loaded: Loaded, device: torch.device, note: str, prompts: list[list[int]]) -> None:
    c = loaded.model.config
    console = stderr_console()
    console.print(f"[dim]{loaded.path} (step {loaded.step}; {c.n_layer} layers, {c.n_embd} wide, "
                  f"block_size {c.block_size}) on {device}{note}; KV cache {'on' if cfg.cache else 'off'}"
                  f"{', decode step compiled' if cfg.compile else ''}[/]")
    long = [len(p) for p in prompts if len(p) > c.block_size]
    if len(prompts) == 1 and long:
        console.print(f"[yellow]the prompt is {long[0]} tokens, longer than block_size {c.block_size}: "
                      f"the first {long[0] - c.block_size} are dropped (the model sees only its last "
                      f"{c.block_size})[/]")
    elif long:
        console.print(f"[yellow]{len(long)} prompts are longer than block_size {c.block_size}: each is cropped "
                      f"to its last {c.block_size} tokens[/]")


def _report(cfg: GenerateConfig, runs: list[Generation], streamed: bool) -> str:
    tokens = sum(g.total_tokens for g in runs)
    seconds = sum(g.seconds for g in runs)
    first = runs[0].first_token_s
    after = tokens - sum(1 for g in runs for s in g.sequences if s)
    steady = after / (seconds - first) if after > 0 and seconds > first else None
    prompts = sum(len(g.sequences) for g in runs)
    what = f"{tokens} tokens" if prompts == 1 else f"{prompts} prompts (batches of up to {cfg.batch_size}), {tokens} tokens"
    warm = runs[0].warmup_s
    return (
        f"[bold]{what} in {seconds:.3f} s: {tokens / seconds if seconds > 0 else float('inf'):.1f} tokens/s[/] "
        f"(first token after {first * 1e3:.1f} ms for a {runs[0].prompt_tokens}-token prompt"
        + (f"; then {steady:.1f} tokens/s" if steady is not None else "")
        + (f"; cache re-filled {sum(g.cache_refills for g in runs)} times past block_size"
           if any(g.cache_refills for g in runs) else "")
        + f"; KV cache {'on' if cfg.cache else 'off'}, seed {cfg.seed}"
        + ("; printing included" if streamed else "") + ")"
        + (f"; compile and warm-up {warm:.2f} s, not counted" if cfg.compile else "")
    )


def _without_cache(cfg: GenerateConfig, loaded: Loaded) -> tuple[GenerateConfig, str]:
    """A model without perfrun's KV cache and decode step (model=hf: transformers' own cache is
    not perfrun's static one) generates by recomputing its context, said in the header;
    compile=true, which compiles the cached decode step, is refused for it."""
    if contract.has(loaded.model, "decoder"):
        return cfg, ""
    name = getattr(loaded.model, "architecture_class", type(loaded.model)).__name__
    if cfg.compile:
        raise ConfigError(f"compile=true compiles the KV-cached decode step, and the checkpoint's model has none in "
                          f"perfrun ({contract.NEEDS['decoder']}); drop compile=true")
    return replace(cfg, cache=False), f"; no KV cache for {name} in perfrun: each token recomputes its context"


def run(cfg: GenerateConfig) -> int:
    """The job: 0 on success, 2 for a user's mistake, 1 when the device runs out of memory."""
    try:
        loaded, tokenizer, texts, device = _load(cfg)
        cfg, note = _without_cache(cfg, loaded)
    except ConfigError as e:
        error(str(e))
        return 2
    if cfg.quantize == "int8":
        from perfrun.inference.int8 import quantize_int8

        try:
            note += f", {quantize_int8(loaded.model).describe()}"
        except ConfigError as e:
            error(str(e))
            return 2
    prompts = [tokenizer.encode(t) for t in texts]
    _header(cfg, loaded, device, note, prompts)
    single = cfg.prompts_file is None
    streamer = Streamer(tokenizer) if single and cfg.stream is not False else None
    try:
        runs = _generate(cfg, loaded, tokenizer, texts, prompts, streamer)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        error(f"out of memory generating {len(prompts)} prompt(s) of up to {max(map(len, prompts))} tokens + "
              f"max_new_tokens={cfg.max_new_tokens} ({str(e).splitlines()[0][:120]}); lower batch_size or max_new_tokens")
        return 1
    stderr_console().print(_report(cfg, runs, streamer is not None))
    return 0


def _generate(cfg: GenerateConfig, loaded: Loaded, tokenizer: Tokenizer, texts: list[str], prompts: list[list[int]],
              streamer: Streamer | None) -> list[Generation]:
    """Generate for every prompt in batches of ``batch_size``, printing each batch's results."""
    batch = 1 if cfg.prompts_file is None else min(cfg.batch_size, len(prompts))
    gen = Generator(loaded.model, Sampler(cfg.temperature, cfg.top_k, loaded.vocab_size, cfg.seed),
                    cfg.max_new_tokens, longest_prompt=max(map(len, prompts)), batch=batch, cache=cfg.cache,
                    compile=cfg.compile, eot_id=tokenizer.eot_id)
    if streamer is not None:
        sys.stdout.write(texts[0])
        sys.stdout.flush()
    runs = []
    for lo in range(0, len(prompts), batch):
        g = gen.run(prompts[lo: lo + batch], on_token=streamer)
        runs.append(g)
        if streamer is not None:
            streamer.close()
        elif cfg.prompts_file is None:
            print(texts[0] + tokenizer.decode(g.tokens))
        else:
            for text, seq, stopped in zip(texts[lo: lo + batch], g.sequences, g.stopped, strict=True):
                print(json.dumps({"prompt": text, "completion": tokenizer.decode(seq), "tokens": len(seq),
                                  "stopped_by": "end-of-text" if stopped else "max_new_tokens"}, ensure_ascii=False))
            sys.stdout.flush()
    return runs


COMMAND = HydraCommand(
    "generate", GenerateConfig, run, raw_keys=("prompt",),
    aliases={"--no-cache": "cache=false", "--cache": "cache=true", "top_k=none": "top_k=null",
             "top_k=None": "top_k=null", "top_k=": "top_k=null"},
)


def main(argv: list[str]) -> int:
    """``perfrun generate KEY=VALUE...``: 0 on success, 2 for a user's mistake."""
    return COMMAND.main(argv)
