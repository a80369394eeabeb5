"""``perfrun generate``'s typed configuration and its prompts, checked before any model is loaded."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from perfrun.config import ConfigError
from perfrun.devices import resolve_device

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
