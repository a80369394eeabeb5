#!/usr/bin/env python3
"""Benchmark perfrun's trainer against a plain PyTorch loop on the same model and batches.

    python scripts/bench_train.py [--steps N] [--repeats R] [--no-baseline] [hydra overrides ...]

Runs perfrun (``perfrun.loop.run.run``, telemetry and sinks included, progress off) and a
plain loop written directly against torch (same model init, same DataLoader order, same
fused AdamW, same autocast dtype and torch.compile choice, nothing else), alternating
the two R times so that drift on a shared machine hits both alike. Both report the mean
tokens/s over the steps after the warm-up (the plain loop synchronises only at the two
ends of that window; perfrun's figure is summary.json's ``tokens_per_s_mean``, from
its per-step CUDA events or perf_counter); the ratio perfrun / plain is the overhead
figure (target >= 0.98).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.config import (
    config_dir,  # noqa: E402
    register_configs,  # noqa: E402
    typed,  # noqa: E402
)
from perfrun.data import build_datasets, build_loader  # noqa: E402
from perfrun.devices import resolve_device  # noqa: E402
from perfrun.distributed import seed_everything  # noqa: E402
from perfrun.knobs.precision import DTYPES  # noqa: E402
from perfrun.loop.optimizer import build_optimizer, build_scheduler  # noqa: E402
from perfrun.loop.run import run  # noqa: E402
from perfrun.models.gpt import GPT, GPTConfig, padded_vocab  # noqa: E402
from perfrun.telemetry.step_metrics import median  # noqa: E402


def plain_loop(cfg: Any, warmup: int) -> dict[str, float]:
    """The loop a user would write by hand: no telemetry, no logging, no progress bar."""
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    seq_len = cfg.data.seq_len or cfg.model.block_size
    data = build_datasets(cfg.data, seq_len, cfg.seed)
    m = cfg.model
    model = GPT(GPTConfig(vocab_size=padded_vocab(data.vocab_size), block_size=m.block_size, n_layer=m.n_layer,
                          n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                          attention=cfg.attention)).to(device)
    opt, _ = build_optimizer(model, cfg.optim, device)
    sched = build_scheduler(opt, cfg.optim, cfg.max_steps)
    step_model = torch.compile(model) if cfg.compile else model
    dtype = DTYPES[cfg.precision.dtype]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    loader = build_loader(data.train, cfg.dataloader, device_type=device.type, shuffle=True, seed=cfg.seed)
    it = iter(loader)
    micro = cfg.accumulation.steps
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_warm = None
    for i in range(cfg.max_steps):
        if i == warmup:  # one synchronisation at the start of the timed window, one at its end
            sync()
            t_warm = time.perf_counter()
        for _ in range(micro):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                _, loss = step_model(x, y)
            scaler.scale(loss / micro).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
    sync()
    elapsed = time.perf_counter() - t_warm
    if cfg.compile:
        torch.compiler.reset()
    steps = cfg.max_steps - warmup
    tokens_per_step = cfg.dataloader.batch_size * seq_len * micro
    return {"tokens_per_s": tokens_per_step * steps / elapsed, "step_ms": 1000 * elapsed / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain loop (e.g. on a GPU run)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=[f"max_steps={args.steps}", f"timing_warmup_steps={args.warmup}",
                                          "progress=off", f"eval_every={args.steps}", "eval_batches=1",
                                          "checkpoint.at_end=false", *args.overrides])
    rows: list[dict[str, Any]] = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            s = run(typed(cfg), Path(d))
        rows.append({"repeat": r, "impl": "perfrun", "tokens_per_s": s["tokens_per_s_mean"],
                     "step_ms": 1000 * s["tokens_per_step"] / s["tokens_per_s_mean"], "mfu": s["mfu_median"], "peak_mem_mib": s["peak_mem_mib"],
                     "device": s["environment"]["device_name"], "mfu_peak_source": s["mfu_peak_source"]})
        if not args.no_baseline:
            rows.append({"repeat": r, "impl": "plain", **plain_loop(cfg, args.warmup)})

    print(f"config: {' '.join(args.overrides) or '(defaults)'}; steps {args.steps}, warm-up {args.warmup}, "
          f"repeats {args.repeats}; device {rows[0]['device']}")
    print(f"{'repeat':>6} {'impl':>8} {'tokens/s':>12} {'ms/step':>9} {'MFU %':>7} {'peak MiB':>9}")
    for row in rows:
        mfu = row.get("mfu")
        print(f"{row['repeat']:>6} {row['impl']:>8} {row['tokens_per_s']:>12,.0f} {row['step_ms']:>9.2f} "
              f"{'n/a' if mfu is None else format(100 * mfu, '.1f'):>7} "
              f"{row.get('peak_mem_mib') or float('nan'):>9,.0f}")
    ours = median([r["tokens_per_s"] for r in rows if r["impl"] == "perfrun"])
    result: dict[str, Any] = {"config": args.overrides, "rows": rows, "perfrun_tokens_per_s": ours}
    if not rows[0].get("mfu"):
        print(f"MFU: {rows[0]['mfu_peak_source']}")
    if not args.no_baseline:
        plain = median([r["tokens_per_s"] for r in rows if r["impl"] == "plain"])
        ratio = ours / plain
        result.update(plain_tokens_per_s=plain, ratio=ratio)
        print(f"mean tokens/s (median over repeats): perfrun {ours:,.0f}, plain {plain:,.0f}; ratio perfrun/plain = {ratio:.3f} "
              f"(target >= 0.98: {'met' if ratio >= 0.98 else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
