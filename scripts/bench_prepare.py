#!/usr/bin/env python3
"""``perfrun prepare`` against a plain single-process loop on the same corpus: the
standard library's *.py files (what data=pysource reads), tokenised by the same BPE.

    python scripts/bench_prepare.py [--repeats 3] [--workers 0] [--tokenizer PATH|tiktoken:gpt2]
                                    [--out outputs/bench-prepare.json]

Without --tokenizer, a byte-level BPE of 8192 ids (GPT-2's kind) is trained first on
4 MiB of the corpus. The two are run alternately, ``--repeats`` times each; the figures
are tokens per second over the wall time of the whole job (reading, tokenising, writing),
with the median and the range of the repeats, and the ratio of the medians. Both must
produce the same number of tokens, or the script stops.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402
from rich.console import Console  # noqa: E402

from perfrun.data.pysource import pysource_files, stdlib_dir  # noqa: E402
from perfrun.data.tokenizers import load_tokenizer, train_bpe  # noqa: E402
from perfrun.prepare.build import prepare  # noqa: E402
from perfrun.prepare.schema import PrepareConfig  # noqa: E402


def link_corpus(folder: Path) -> tuple[int, int]:
    """The stdlib's *.py files as links under ``folder``; (files, bytes)."""
    stdlib = stdlib_dir()
    files = pysource_files(stdlib)
    for rel, _ in files:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).symlink_to(stdlib / rel)
    return len(files), sum(size for _, size in files)


def plain_loop(corpus: Path, spec: str, out: Path) -> tuple[int, float]:
    """What one would write by hand: each file read, encoded, its ids and the end-of-text
    id appended, all written as uint16 at the end. Returns (tokens, seconds)."""
    t0 = time.perf_counter()
    tok = load_tokenizer(spec)
    ids: list[int] = []
    for path in sorted(p for p in corpus.rglob("*") if p.is_file() and p.stat().st_size > 0):
        ids += tok.encode(path.read_bytes().decode("utf-8", errors="replace"))
        if tok.eot_id is not None:
            ids.append(tok.eot_id)
    np.asarray(ids, dtype=np.uint16).tofile(out)
    return len(ids), time.perf_counter() - t0


def with_prepare(corpus: Path, spec: str, out: Path, workers: int) -> tuple[int, float, int]:
    """``perfrun prepare`` itself; (tokens, seconds, workers used)."""
    cfg = OmegaConf.structured(PrepareConfig(path=str(corpus), out=str(out), tokenizer=spec, workers=workers,
                                             progress=False))
    done = prepare(cfg, Console(stderr=True, quiet=True))
    return done.meta.train_tokens + done.meta.val_tokens, done.seconds, done.workers


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def parallel_ceiling(workers: int, n: int = 5_000_000) -> float:
    """What ``workers`` processes buy on this machine at this moment: the same pure-Python
    work done ``workers`` times serially, over the time of a pool doing it at once. On a
    machine that other jobs keep busy it stays near 1, and so must prepare's gain."""
    t0 = time.perf_counter()
    for _ in range(workers):
        _spin(n)
    serial = time.perf_counter() - t0
    with multiprocessing.get_context().Pool(workers) as pool:
        t0 = time.perf_counter()
        pool.map(_spin, [n] * workers)
        return serial / (time.perf_counter() - t0)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(rates: list[float]) -> dict[str, float]:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="prepare's workers (0: one per core)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer spec; default: a BPE trained here")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench-prepare.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        files, size = link_corpus(d / "corpus")
        spec = args.tokenizer
        if spec is None:
            sample, got = [], 0
            for path in sorted((d / "corpus").rglob("*.py")):
                if got > 4 << 20:
                    break
                sample.append(path.read_text(encoding="utf-8", errors="replace"))
                got += len(sample[-1])
            spec = str(train_bpe(sample, 8192, d / "tokenizer.json"))
        runs: dict[str, list[float]] = {"prepare": [], "plain loop": []}
        ceilings: list[float] = []
        counts: set[int] = set()
        workers = 0
        for i in range(args.repeats):
            n, s, workers = with_prepare(d / "corpus", spec, d / f"prepared{i}", args.workers)
            runs["prepare"].append(n / s)
            counts.add(n)
            n, s = plain_loop(d / "corpus", spec, d / f"plain{i}.bin")
            runs["plain loop"].append(n / s)
            counts.add(n)
            ceilings.append(parallel_ceiling(workers))
            print(f"repeat {i + 1}: prepare {runs['prepare'][-1]:,.0f} tokens/s, plain loop {runs['plain loop'][-1]:,.0f}, "
                  f"{workers} processes of pure Python {ceilings[-1]:.2f}x one")
        if len(counts) != 1:
            raise SystemExit(f"the two produced different numbers of tokens ({sorted(counts)}): not the same work")
    import tokenizers

    result = {
        "command": "python scripts/bench_prepare.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "corpus": f"{files} *.py files of the standard library ({size / 2**20:.1f} MiB)",
        "tokens": counts.pop(),
        "tokenizer": args.tokenizer or "byte-level BPE, 8192 ids, trained on 4 MiB of the corpus",
        "workers": workers,
        "repeats": args.repeats,
        "tokens_per_s": {name: summary(rates) for name, rates in runs.items()},
        "ratio_of_medians": statistics.median(runs["prepare"]) / statistics.median(runs["plain loop"]),
        "parallel_ceiling": summary(ceilings),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_1min_at_end": os.getloadavg()[0]},
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__, "numpy": np.__version__},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, fig in result["tokens_per_s"].items():
        print(f"{name:>10}: {fig['median']:,.0f} tokens/s (median; {fig['min']:,.0f}-{fig['max']:,.0f} over {args.repeats})")
    c = result["parallel_ceiling"]
    print(f"ratio {result['ratio_of_medians']:.2f} with {workers} workers (the machine's ceiling for {workers} processes: "
          f"{c['median']:.2f}x, {c['min']:.2f}-{c['max']:.2f}); {result['tokens']:,} tokens; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
