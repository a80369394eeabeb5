"""``data=synthetic``: random tokens, to measure the model alone (no I/O)."""

from __future__ import annotations

import numpy as np

from perfrun.config import ConfigError, DataConfig
from perfrun.data.windows import DEFAULT_VOCAB, DataBundle, Windows

SYNTHETIC_WINDOWS = 1 << 20  # virtual length of each synthetic split


class SyntheticTokens(Windows):
    """Random tokens in [0, vocab_size), a pure function of (seed, stream, index).

    Any process, any worker count and any order of access gives the same window for an
    index, so runs are reproducible and the loader does no I/O.
    """

    def __init__(
        self, *, vocab_size: int, seq_len: int, seed: int, stream: int, windows: int
    ) -> None:
        super().__init__(windows * seq_len + 1, seq_len)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF  # SeedSequence wants non-negative
        self.stream = int(stream)

    def window(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, index])
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)


def synthetic_bundle(cfg: DataConfig, seq_len: int, seed: int) -> DataBundle:
    vocab = int(cfg.vocab_size) if cfg.vocab_size is not None else DEFAULT_VOCAB
    if vocab < 2:
        raise ConfigError(f"data.vocab_size={vocab} must be >= 2; set data.vocab_size=50257")
    train = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed, stream=0,
                            windows=SYNTHETIC_WINDOWS)
    val = SyntheticTokens(vocab_size=vocab, seq_len=seq_len, seed=seed, stream=1,
                          windows=SYNTHETIC_WINDOWS)
    desc = (f"synthetic: random tokens, vocab {vocab}, {SYNTHETIC_WINDOWS} windows of "
            f"{seq_len} per split (seed {seed}, no I/O)")
    return DataBundle(train, val, vocab, desc)
