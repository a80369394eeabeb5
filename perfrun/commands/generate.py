"""``perfrun generate``: sample text from a checkpoint, with or without a KV cache, timed.

A Hydra app over :class:`~perfrun.inference.schema.GenerateConfig` (``perfrun generate --help``
lists every key).
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
import sys
from dataclasses import replace
from pathlib import Path

import torch

from perfrun.commands.hydra_app import HydraCommand
from perfrun.config import ConfigError
from perfrun.console import error, stderr_console
from perfrun.data.tokenizers import Tokenizer
from perfrun.devices import resolve_device
from perfrun.inference.generation import Generation, Generator
from perfrun.inference.loading import Loaded, load_model
from perfrun.inference.sampling import Sampler
from perfrun.inference.schema import GenerateConfig
from perfrun.inference.streaming import Streamer
from perfrun.models import contract


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
