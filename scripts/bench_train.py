#!/usr/bin/env python3
"""perfrun's step against a plain PyTorch loop on the same module: paired, with an interval.

    python scripts/bench_train.py [--pairs N] [--steps S] [--warmup W] [--configs NAME,...]
                                  [--threads T] [--json FILE] [--calls] [hydra overrides ...]

Each pair runs perfrun (``perfrun.loop.run.run``: telemetry, guard, sinks, and for the
``on`` configurations the monitor and the progress bar as a terminal shows them) and a
plain loop written directly against torch (the same model, built by perfrun.models.build as
perfrun builds it: GPT, Llama or your own; same init, same DataLoader order,
same fused AdamW and schedule, same autocast dtype and compile choice, nothing else), each
in a fresh Python process started the same way, with the same thread settings (OMP and MKL
threads in the environment, ``torch.set_num_threads`` in the process; both are read back
and reported). Fresh processes, not one process: nothing either side leaves behind (thread
pools, the allocator's cache, knobs' global state, the monitor's thread, compiled frames)
reaches the other, and each side starts as a user's command does. The order alternates
(perfrun first, then plain first) so drift on a shared machine hits both alike.

Both sides report the mean tokens/s over the steps after the warm-up (the plain loop times
that window with perf_counter; perfrun's figure is summary.json's ``tokens_per_s_mean``,
its per-step perf_counter marks over the same window). Per configuration: the median of
the per-pair ratios perfrun / plain, its 95 % interval by the sign test (distribution-free:
order statistics of the ratios; it needs 6 pairs) and by a percentile bootstrap of the
median, and what the machine did meanwhile: the load average, and the share of the CPUs
that other processes used during the pairs (psutil), with the busiest of them named.

``--plain-heap perfrun`` gives the plain loop the C heap thresholds a perfrun CPU run fixes
(perfrun/loop/host_heap.py), so that the ratio is the step's alone; by default the plain loop
runs with glibc's defaults, as a user's script would.

``--calls`` instead counts, per step of each side, the Python calls (cProfile) and the aten
operators dispatched (deterministic both, so valid on a busy machine), and the pages the
step faulted in with the kernel CPU time they cost (getrusage, unprofiled runs of their
own; the faults depend on the C heap's state, not on the machine's load): each side runs in one
process at ``S`` and ``2S`` steps after an unprofiled warm run, and the difference over ``S``
steps is the per-step count; the functions with the most calls per step, and the operators
perfrun runs more often than the plain loop, are listed. The monitor's sampler thread is not
in it (cProfile follows the main thread; the monitor samples on a timer, not per step).

A Hugging Face folder: ``--hf FOLDER --configs hf-fp32-off`` (model=hf; the plain loop steps the
same transformers module perfrun builds from the folder).

GPU use (scripts/gpu_bench.sh trainer): ``--pairs 3 --configs custom model=gpt2 ... device=cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import fnmatch
import json
import math
import os
import pstats
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402

from perfrun.config import config_dir, register_configs, typed  # noqa: E402
from perfrun.data import build_datasets, build_loader  # noqa: E402
from perfrun.devices import resolve_device  # noqa: E402
from perfrun.distributed import seed_everything  # noqa: E402
from perfrun.knobs.precision import DTYPES  # noqa: E402
from perfrun.models.build import build_model  # noqa: E402
from perfrun.optim.adamw import build_optimizer, build_scheduler  # noqa: E402

SIZES = {"tiny": [], "4x256": ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=256",
                               "dataloader.batch_size=8"], "llama-tiny": ["model=llama-tiny"]}
PRECISIONS = {"fp32": ["precision=none"], "bf16": ["precision=bf16"]}
# on: what a user gets at a terminal (the monitor every 10 steps, the progress bar); off: both off
DEFAULTS = {"on": ["monitor.every_n_steps=10", "progress=bar"], "off": ["monitor.every_n_steps=0", "progress=off"]}
CONFIGS = {f"{s}-{p}-{d}": [*SIZES[s], *PRECISIONS[p], *DEFAULTS[d]]
           for s in SIZES for p in PRECISIONS for d in DEFAULTS}
SIGN_TEST_MIN_PAIRS = 6  # below this no pair of order statistics covers the median with 95 %


def plain_loop(cfg: Any, warmup: int) -> dict[str, float]:
    """The loop a user would write by hand: no telemetry, no logging, no progress bar."""
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    seq_len = cfg.data.seq_len or cfg.model.block_size
    data = build_datasets(cfg.data, seq_len, cfg.seed)
    m = cfg.model
    model = build_model(m, data.vocab_size, cfg.attention).to(device)  # the module perfrun trains
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


def compose_cfg(steps: int, warmup: int, overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return typed(compose("train", overrides=[f"max_steps={steps}", f"timing_warmup_steps={warmup}",
                                                 "progress=off", f"eval_every={steps}", "eval_batches=1",
                                                 "checkpoint.at_end=false", *overrides]))


def one_side(side: str, cfg: Any, warmup: int) -> dict[str, Any]:
    """One run of one side in this process: its tokens/s over the steps after the warm-up."""
    if side == "plain":
        return plain_loop(cfg, warmup)
    from perfrun.loop.run import run

    with tempfile.TemporaryDirectory() as d:
        s = run(cfg, Path(d))
    return {"tokens_per_s": s["tokens_per_s_mean"], "step_ms": 1000 * s["tokens_per_step"] / s["tokens_per_s_mean"],
            "mfu": s["mfu_median"], "peak_mem_mib": s["peak_mem_mib"], "device": s["environment"]["device_name"]}


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched (each a fixed host cost on the CPU, a launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def per_step(a: dict[str, int], b: dict[str, int], steps: int) -> dict[str, float]:
    """What the run of ``2 * steps`` did more than the run of ``steps``, per step."""
    out = {k: (b.get(k, 0) - a.get(k, 0)) / steps for k in set(a) | set(b)}
    return dict(sorted(((k, v) for k, v in out.items() if v > 0), key=lambda kv: -kv[1]))


def calls_per_step(side: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    """Python calls (cProfile) and aten operators (a dispatch mode, in runs of their own) per
    step of one side: runs of S and 2S steps after a warm run; the difference over S steps
    (setup and the end's evaluation cancel out)."""
    cfgs = {n: compose_cfg(n, 0, overrides) for n in (steps, 2 * steps)}  # a run never writes into its config
    one_side(side, cfgs[steps], 0)  # imports, caches, lazy initialisation
    calls, ops, faults = [], [], []
    for cfg in cfgs.values():
        before = resource.getrusage(resource.RUSAGE_SELF)
        one_side(side, cfg, 0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append({"minor_faults": after.ru_minflt - before.ru_minflt,
                       "kernel_cpu_ms": 1000 * (after.ru_stime - before.ru_stime)})
        prof = cProfile.Profile()
        prof.enable()
        one_side(side, cfg, 0)
        prof.disable()
        calls.append({f"{Path(f).name}:{line}({name})": v[1] for (f, line, name), v in pstats.Stats(prof).stats.items()})
        with OpCount() as mode:
            one_side(side, cfg, 0)
        ops.append(dict(mode.counts))
    per_call, per_op = per_step(*calls, steps), per_step(*ops, steps)
    fault = {k: (faults[1][k] - faults[0][k]) / steps for k in faults[0]}
    return {"calls_per_step": sum(per_call.values()), "top": dict(list(per_call.items())[:30]),
            "minor_faults_per_step": fault["minor_faults"], "kernel_cpu_ms_per_step": fault["kernel_cpu_ms"],
            "aten_ops_per_step": sum(per_op.values()), "aten_ops": per_op}


def child(args: argparse.Namespace) -> int:
    """``--one SIDE``: set the threads, run one side, print one JSON line."""
    torch.set_num_threads(args.threads)
    if args.one == "plain" and args.plain_heap == "perfrun":
        from perfrun.loop.host_heap import keep_freed_memory

        keep_freed_memory()  # the C heap's thresholds as a perfrun CPU run sets them (perfrun/loop/host_heap.py)
    if args.calls:
        out = calls_per_step(args.one, args.steps, args.overrides)
    else:
        out = one_side(args.one, compose_cfg(args.steps, args.warmup, args.overrides), args.warmup)
    out.update(torch_threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
               omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    print("BENCH_TRAIN " + json.dumps(out, default=str), flush=True)
    return 0


def spawn(side: str, args: argparse.Namespace, overrides: list[str], *, calls: bool = False) -> dict[str, Any]:
    """One side in a fresh process, started the same way for both sides."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TTY_COMPATIBLE": "1", "COLUMNS": "120", "PYTHONHASHSEED": "0"}  # the bar as a terminal renders it
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", side, "--threads", str(args.threads),
           "--plain-heap", args.plain_heap,
           "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--calls"] if calls else []), *overrides]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = res.stdout.rpartition("BENCH_TRAIN ")[2].split("\n", 1)[0] if "BENCH_TRAIN " in res.stdout else None
    if res.returncode != 0 or not line:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {side} run failed (exit {res.returncode}): {tail}")
    return json.loads(line)  # after the progress bar's control codes, where it drew one


class MachineWatch:
    """What the machine did during a window: load average, and the share of all CPUs that
    processes other than this benchmark (and its children) used, with the busiest named."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.t0 = time.perf_counter()
        self.cpu0 = psutil.cpu_times()
        self.own0 = self._own()
        self.procs0 = self._procs()
        self.load: list[float] = [os.getloadavg()[0]]

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def _procs(self) -> dict[int, tuple[str, float]]:
        out = {}
        for p in psutil.process_iter(["name", "cpu_times"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if p.pid != self.me:
                    out[p.pid] = (p.info["name"], p.info["cpu_times"].user + p.info["cpu_times"].system)
        return out

    def tick(self) -> None:
        self.load.append(os.getloadavg()[0])

    def report(self) -> dict[str, Any]:
        wall, cpu1 = time.perf_counter() - self.t0, psutil.cpu_times()
        busy = (sum(cpu1) - cpu1.idle - getattr(cpu1, "iowait", 0)) - (sum(self.cpu0) - self.cpu0.idle
                                                                       - getattr(self.cpu0, "iowait", 0))
        others = max(0.0, busy - (self._own() - self.own0))
        ncpu = psutil.cpu_count() or 1
        used: dict[str, float] = {}
        for pid, (name, t) in self._procs().items():
            if pid in self.procs0 and self.procs0[pid][0] == name and t > self.procs0[pid][1]:
                used[name] = used.get(name, 0.0) + t - self.procs0[pid][1]
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:3]
        return {"cpus": ncpu, "wall_s": wall, "load_avg_1m": {"min": min(self.load), "max": max(self.load)},
                "others_cpu_share_pct": 100 * others / (wall * ncpu) if wall > 0 else None,
                "busiest_others": [f"{n} {100 * t / (wall * ncpu):.0f}%" for n, t in busiest]}


def sign_test_interval(ratios: list[float]) -> tuple[float, float] | None:
    """The distribution-free 95 % interval of the median: order statistics k and n-k+1, k
    the largest with P(Binomial(n, 1/2) < k) <= 2.5 %; None below 6 values."""
    n = len(ratios)
    if n < SIGN_TEST_MIN_PAIRS:
        return None
    cdf, k = 0.0, 0
    while True:
        nxt = cdf + math.comb(n, k) / 2**n
        if nxt > 0.025:
            break
        cdf, k = nxt, k + 1
    s = sorted(ratios)
    return (s[k - 1], s[n - k]) if k >= 1 else None


def bootstrap_interval(ratios: list[float], resamples: int = 10000) -> tuple[float, float] | None:
    """Percentile bootstrap of the median (seeded: the same ratios give the same interval)."""
    if len(ratios) < 2:
        return None
    rng = random.Random(0)
    meds = sorted(sorted(rng.choices(ratios, k=len(ratios)))[len(ratios) // 2] for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def measure(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``args.pairs`` pairs of one configuration, alternating which side runs first."""
    watch, pairs = MachineWatch(), []
    for i in range(args.pairs):
        order = ("perfrun", "plain") if i % 2 == 0 else ("plain", "perfrun")
        got = {side: spawn(side, args, overrides) for side in order}
        watch.tick()
        ratio = got["perfrun"]["tokens_per_s"] / got["plain"]["tokens_per_s"]
        pairs.append({"first": order[0], "perfrun": got["perfrun"], "plain": got["plain"], "ratio": ratio})
        print(f"  {name} pair {i + 1}/{args.pairs} ({order[0]} first): perfrun "
              f"{got['perfrun']['tokens_per_s']:,.0f}, plain {got['plain']['tokens_per_s']:,.0f} tokens/s, "
              f"ratio {ratio:.3f}", flush=True)
    ratios = [p["ratio"] for p in pairs]
    sides = {s: {(p[s]["torch_threads"], p[s]["interop_threads"], p[s]["omp_num_threads"]) for p in pairs}
             for s in ("perfrun", "plain")}
    return {"overrides": overrides, "pairs": pairs, "median_ratio": sorted(ratios)[len(ratios) // 2]
            if len(ratios) % 2 else sum(sorted(ratios)[len(ratios) // 2 - 1:len(ratios) // 2 + 1]) / 2,
            "ci95_sign_test": sign_test_interval(ratios), "ci95_bootstrap": bootstrap_interval(ratios),
            "threads": {s: sorted(map(list, v)) for s, v in sides.items()}, "machine": watch.report()}


def show(name: str, r: dict[str, Any]) -> str:
    def ci(v: Any) -> str:
        return "n/a" if v is None else f"[{v[0]:.3f}, {v[1]:.3f}]"

    m = r["machine"]
    share = m["others_cpu_share_pct"]
    return (f"{name:<20} {len(r['pairs']):>5} {r['median_ratio']:>8.3f} {ci(r['ci95_sign_test']):>16} "
            f"{ci(r['ci95_bootstrap']):>16} {m['load_avg_1m']['min']:>5.1f}-{m['load_avg_1m']['max']:<5.1f} "
            f"{'n/a' if share is None else format(share, '.0f') + '%':>7}  {', '.join(m['busiest_others'])}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", "--repeats", type=int, default=10,
                    help="pairs per configuration (6 or more for the sign test); --repeats: its earlier name")
    ap.add_argument("--no-baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--configs", default="tiny-*",
                    help=f"comma-separated names or globs of {', '.join(CONFIGS)}; 'custom': the overrides alone")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch and OpenMP threads, both sides")
    ap.add_argument("--plain-heap", choices=("system", "perfrun"), default="system",
                    help="the plain loop's C heap: glibc's defaults as a user's script has them (system), or the "
                         "thresholds a perfrun CPU run fixes (perfrun): the step alone, the heap's effect set apart")
    ap.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    ap.add_argument("--json", type=Path, help="also write the figures here (after every configuration)")
    ap.add_argument("--hf", type=Path, metavar="FOLDER",
                    help="a Hugging Face model folder: the configurations hf-fp32-off, hf-bf16-on, ... train it "
                         "(model=hf model.path=FOLDER, its vocabulary's synthetic tokens); the plain loop steps "
                         "the same transformers module")
    ap.add_argument("--one", choices=("perfrun", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="hydra overrides added to every configuration (e.g. device=cpu)")
    args = ap.parse_args(argv)
    if args.no_baseline:
        ap.error("--no-baseline is gone: every figure here is a ratio to the plain loop; "
                 "time perfrun alone with perfrun train (summary.json: tokens_per_s_mean)")
    if args.steps <= args.warmup or args.pairs < 1 or args.threads < 1:
        ap.error("need --steps > --warmup, --pairs >= 1 and --threads >= 1")
    return args


def hf_configs(folder: Path | None) -> dict[str, list[str]]:
    """``--hf FOLDER``: the folder's model in each precision and defaults setting, on random
    tokens of its own vocabulary (the folder's config.json says it)."""
    if folder is None:
        return {}
    vocab = int(json.loads((folder / "config.json").read_text()).get("vocab_size", 256))
    model = ["model=hf", f"model.path={folder}", "data=synthetic", f"data.vocab_size={vocab}", "model.block_size=128",
             "dataloader.batch_size=8"]
    return {f"hf-{p}-{d}": [*model, *PRECISIONS[p], *DEFAULTS[d]] for p in PRECISIONS for d in DEFAULTS}


def chosen(spec: str, extra: dict[str, list[str]] | None = None) -> dict[str, list[str]] | None:
    out: dict[str, list[str]] = {}
    known = {**CONFIGS, **(extra or {})}
    for pat in (p.strip() for p in spec.split(",") if p.strip()):
        hit = {"custom": []} if pat == "custom" else {n: o for n, o in known.items() if fnmatch.fnmatch(n, pat)}
        if not hit:
            return None
        out.update(hit)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.one:
        return child(args)
    configs = chosen(args.configs, hf_configs(args.hf))
    if not configs:
        print(f"bench_train.py: --configs {args.configs} matches none of "
              f"{', '.join([*CONFIGS, *hf_configs(args.hf)])} (or 'custom')",
              file=sys.stderr)
        return 2
    result: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads, "steps": args.steps,
                              "plain_heap": args.plain_heap,
                              "warmup": args.warmup, "base": args.overrides, "configs": {}}
    for name, overrides in configs.items():
        if args.calls:
            row = {s: spawn(s, args, [*overrides, *args.overrides], calls=True) for s in ("perfrun", "plain")}
            print(f"{name}: per step, perfrun / plain: Python calls {row['perfrun']['calls_per_step']:,.0f} / "
                  f"{row['plain']['calls_per_step']:,.0f}, aten operators {row['perfrun']['aten_ops_per_step']:,.0f} / "
                  f"{row['plain']['aten_ops_per_step']:,.0f}, page faults {row['perfrun']['minor_faults_per_step']:,.0f} / "
                  f"{row['plain']['minor_faults_per_step']:,.0f}, kernel CPU ms "
                  f"{row['perfrun']['kernel_cpu_ms_per_step']:.1f} / {row['plain']['kernel_cpu_ms_per_step']:.1f}",
                  flush=True)
            more = {k: v - row["plain"]["aten_ops"].get(k, 0) for k, v in row["perfrun"]["aten_ops"].items()}
            print("  operators perfrun runs more often: " + (", ".join(
                f"{k} +{v:g}" for k, v in sorted(more.items(), key=lambda kv: -kv[1]) if v > 0) or "none"))
        else:
            row = measure(name, [*overrides, *args.overrides], args)
        result["configs"][name] = row
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))
    if not args.calls:
        print(f"steps {args.steps}, warm-up {args.warmup}, threads {args.threads}, plain loop's heap {args.plain_heap}, "
              f"torch {torch.__version__}; "
              f"ratio = perfrun / plain tokens/s per pair")
        print(f"{'config':<20} {'pairs':>5} {'median':>8} {'95% sign test':>16} {'95% bootstrap':>16} "
              f"{'load':>11} {'others':>7}  busiest others")
        for name, row in result["configs"].items():
            print(show(name, row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
