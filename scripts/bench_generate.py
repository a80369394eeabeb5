#!/usr/bin/env python3
"""Benchmark generation: tokens/s with the KV cache off, on, and on with a compiled decode step,
at each batch size and prompt length, with the ratios, and whether every path gave the same tokens.

    python scripts/bench_generate.py [--checkpoint PATH] [--device auto] [--batches 1,8]
        [--prompts 16,900] [--new-tokens 64] [--repeats 3] [--paths off,cache,compile]
        [--json FILE] [training overrides ...]

Without ``--checkpoint`` it makes one: ``perfrun train`` for ``--train-steps`` steps on
synthetic tokens (the weights need not be good to be timed), GPT-2 124M (block_size 1024)
on CUDA, and on the CPU a small model with block_size 1024 and a byte-sized vocabulary
(``model=tiny model.block_size=1024 data.vocab_size=256``); any ``key=value`` given
replaces those. Prompts are random token ids (seeded); decoding is greedy, so the paths
must give identical tokens. Each path is timed ``--repeats`` times after its warm-up
(compilation included, reported apart) and the median is shown. tokens/s is the
steady-state decode rate (after each sequence's first token, all sequences counted); the
time to the first token (the prompt's prefill, or its full forward) is shown apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.checkpoint import files as checkpoint  # noqa: E402
from perfrun.config import config_dir, register_configs, typed  # noqa: E402
from perfrun.devices import resolve_device  # noqa: E402
from perfrun.inference.generation import Generator  # noqa: E402
from perfrun.inference.loading import Loaded, load_model  # noqa: E402
from perfrun.inference.sampling import Sampler  # noqa: E402
from perfrun.loop.run import run  # noqa: E402

PATHS = {"off": (False, False), "cache": (True, False), "compile": (True, True)}
CPU_MODEL = ["model=tiny", "model.block_size=1024", "data.vocab_size=256"]
GPU_MODEL = ["model=gpt2"]


def make_checkpoint(folder: Path, device: torch.device, steps: int, overrides: list[str]) -> Path:
    """A few training steps on synthetic tokens, saved at the end."""
    register_configs()
    model = GPU_MODEL if device.type == "cuda" else CPU_MODEL
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=[
            *model, "data=synthetic", f"device={device}", f"max_steps={steps}", "dataloader.batch_size=2",
            "eval_every=0", "eval_batches=1", "log_every=1", "monitor.every_n_steps=0", "progress=off",
            "checkpoint.at_end=true", *overrides])
    run(typed(cfg), folder)
    return checkpoint.list_checkpoints(folder / "checkpoints")[-1]


def measure(loaded: Loaded, batch: int, prompt_len: int, new_tokens: int, path: str, repeats: int,
            seed: int = 0) -> dict[str, Any]:
    """One cell: the median tokens/s over ``repeats`` runs after the warm-up, and the tokens."""
    cache, compiled = PATHS[path]
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, loaded.vocab_size, (batch, prompt_len), generator=gen).tolist()
    g = Generator(loaded.model, Sampler(0.0, None, loaded.vocab_size, 0), new_tokens, longest_prompt=prompt_len,
                  batch=batch, cache=cache, compile=compiled)
    runs = [g.run(prompts) for _ in range(repeats)]
    return {"batch": batch, "prompt": prompt_len, "path": path,
            "tokens_per_s": statistics.median(r.decode_tokens_per_s or 0.0 for r in runs),
            "overall_tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
            "first_token_ms": statistics.median(r.first_token_s for r in runs) * 1e3, "warmup_s": runs[0].warmup_s,
            "tokens": runs[0].sequences}


def same_tokens(cells: Any) -> bool:
    return len({json.dumps(c["tokens"]) for c in cells}) == 1


def table(cells: list[dict[str, Any]], paths: list[str]) -> list[str]:
    """A Markdown table: one row per (batch, prompt), tokens/s per path, the ratios, the warm-up."""
    head = ["batch", "prompt"] + [f"{p} tok/s" for p in paths]
    ratios = [(a, b) for a, b in (("cache", "off"), ("compile", "cache"), ("compile", "off")) if a in paths and b in paths]
    head += [f"{a}/{b}" for a, b in ratios] + [f"first token ms ({'/'.join(paths)})"]
    head += (["compile + warm-up s"] if "compile" in paths else []) + ["same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys((c["batch"], c["prompt"]) for c in cells):
        row = {c["path"]: c for c in cells if (c["batch"], c["prompt"]) == key}
        cols = [str(key[0]), str(key[1])] + [f"{row[p]['tokens_per_s']:,.1f}" for p in paths]
        cols += [f"{row[a]['tokens_per_s'] / row[b]['tokens_per_s']:.2f}x" for a, b in ratios]
        cols.append(" / ".join(f"{row[p]['first_token_ms']:,.0f}" for p in paths))
        cols += [f"{row['compile']['warmup_s']:.1f}"] if "compile" in paths else []
        cols.append("yes" if same_tokens(row.values()) else "NO")
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="a perfrun checkpoint; default: train one (see above)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="16,900", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="off,cache,compile")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the cells (tokens left out) to this file")
    ap.add_argument("overrides", nargs="*", help="training overrides for the checkpoint made here")
    args = ap.parse_args()
    device = resolve_device(args.device)
    paths = [p for p in args.paths.split(",") if p]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or make_checkpoint(Path(tmp), device, args.train_steps, args.overrides)
        loaded = load_model(ckpt, device)
    c = loaded.model.config
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"({torch.get_num_threads()} threads); {c.n_layer} layers, {c.n_embd} wide, block_size {c.block_size}, "
          f"vocabulary {loaded.vocab_size}, fp32, greedy, {args.new_tokens} new tokens, median of {args.repeats}")
    cells = []
    for batch in (int(b) for b in args.batches.split(",")):
        for prompt_len in (int(p) for p in args.prompts.split(",")):
            if prompt_len + args.new_tokens > c.block_size:
                print(f"skipped batch {batch} prompt {prompt_len}: prompt + --new-tokens is over block_size {c.block_size}")
                continue
            for path in paths:
                cells.append(measure(loaded, batch, prompt_len, args.new_tokens, path, args.repeats))
                cell = cells[-1]
                print(f"  batch {batch} prompt {prompt_len} {path}: {cell['tokens_per_s']:,.1f} tokens/s after a first "
                      f"token at {cell['first_token_ms']:,.1f} ms", flush=True)
    print("\n".join(table(cells, paths)))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in c.items() if k != "tokens"} for c in cells], indent=1) + "\n")
    keys = {(c["batch"], c["prompt"]) for c in cells}
    same = all(same_tokens([c for c in cells if (c["batch"], c["prompt"]) == k]) for k in keys)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
