"""``perfrun prepare``'s configuration: one typed dataclass, registered in Hydra's
ConfigStore by :class:`perfrun.commands.hydra_app.HydraCommand` and merged with
conf/prepare.yaml; its fields' help is what ``--help`` lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfrun.config import ConfigError


def _key(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class PrepareConfig:
    path: str | None = _key(None, "the corpus: a text file, a .jsonl file (one JSON document per line) or a folder of them")
    out: str | None = _key(None, "the folder to write train.bin, val.bin and meta.json into (new, empty, or an earlier prepare's)")
    tokenizer: str = _key("byte", "byte | tiktoken:gpt2 | the path of a Hugging Face tokenizer.json")
    val_fraction: float = _key(0.1, "share of the documents (in path order, evenly spread) that go to val.bin")
    workers: int = _key(0, "tokenising processes; 0: one per CPU core")
    text_field: str = _key("text", "the key that holds a .jsonl document's text")
    progress: bool = _key(True, "a progress bar with tokens/s on the terminal")


def validate(cfg: PrepareConfig) -> tuple[Path, Path]:
    """The corpus and the output folder, or a one-line ConfigError."""
    if not cfg.path or not cfg.out:
        missing = " and ".join(k for k in ("path", "out") if not getattr(cfg, k))
        raise ConfigError(f"{missing} {'is' if ' and ' not in missing else 'are'} required; "
                          "perfrun prepare path=CORPUS out=DIR (perfrun prepare --help lists the keys)")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"val_fraction={cfg.val_fraction} must be in (0, 1); set it to 0.1")
    if cfg.workers < 0:
        raise ConfigError(f"workers={cfg.workers} must be >= 0 (0: one per CPU core)")
    if not str(cfg.text_field):
        raise ConfigError("text_field= is empty; give the JSON key that holds each document's text, e.g. text_field=text")
    corpus, out = Path(str(cfg.path)).expanduser(), Path(str(cfg.out)).expanduser()
    if not corpus.exists():
        raise ConfigError(f"path={cfg.path} does not exist; check the spelling or give an absolute path")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={cfg.out} is a file; give a folder for train.bin, val.bin and meta.json")
    if corpus.is_dir() and out.resolve().is_relative_to(corpus.resolve()):
        raise ConfigError(f"out={cfg.out} is inside path={cfg.path}, so its token files would be read as text by "
                          "the next prepare; write them outside the corpus")
    return corpus, out
