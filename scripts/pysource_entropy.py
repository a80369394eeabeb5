#!/usr/bin/env python3
"""The unigram entropy (nats/token) of pysource's validation split: the lowest loss a
model that ignores context can reach, the yardstick for "the default run learns".

    python scripts/pysource_entropy.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.config import DataConfig  # noqa: E402
from perfrun.data import build_datasets  # noqa: E402


def main() -> int:
    val = build_datasets(DataConfig(), seq_len=256, seed=0).val
    tokens = np.concatenate([val[i][0].numpy() for i in range(len(val))])
    counts = np.bincount(tokens, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    print(f"pysource val: {tokens.size:,} tokens, unigram entropy {float(-(p * np.log(p)).sum()):.4f} nats/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
