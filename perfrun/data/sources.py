"""The source named by ``data.name`` (one module each) built into a train and a val set."""

from __future__ import annotations

from perfrun.config import ConfigError, DataConfig
from perfrun.data.custom import custom_bundle
from perfrun.data.memmap import memmap_bundle
from perfrun.data.pysource import pysource_bundle
from perfrun.data.synthetic import synthetic_bundle
from perfrun.data.text import text_bundle
from perfrun.data.windows import DataBundle


def build_datasets(data_cfg: DataConfig, seq_len: int, seed: int) -> DataBundle:
    """Train and val datasets for ``data_cfg.name``; bad input raises a one-line ConfigError."""
    seq_len = int(seq_len)
    if seq_len < 1:
        raise ConfigError(f"data.seq_len={seq_len} must be >= 1; set data.seq_len=null for the model's block_size")
    name = str(data_cfg.name)
    if name == "pysource":
        return pysource_bundle(data_cfg, seq_len)
    if name == "text":
        return text_bundle(data_cfg, seq_len)
    if name == "memmap":
        return memmap_bundle(data_cfg, seq_len)
    if name == "synthetic":
        return synthetic_bundle(data_cfg, seq_len, int(seed))
    if name == "custom":
        return custom_bundle(data_cfg, seq_len)
    raise ConfigError(f"data.name={name} is not an option; choose one of pysource, text, memmap, synthetic, custom")
