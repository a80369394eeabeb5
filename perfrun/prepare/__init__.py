"""``perfrun prepare path=CORPUS out=DIR tokenizer=...``: a corpus of text files and
``.jsonl`` documents to the ``train.bin``/``val.bin`` token files that ``data=memmap``
reads, with a ``meta.json`` that records the tokenizer and the vocabulary.

A Hydra app like ``perfrun train``: the keys are typed by :mod:`perfrun.prepare.schema`
and composed from conf/prepare.yaml, so ``--help`` lists them, ``--cfg job`` prints the
configuration and a wrong key or type is one line. The work is in
:mod:`perfrun.prepare.build` (writing, atomically) and :mod:`perfrun.prepare.corpus`
(reading and tokenising, in worker processes).
"""

from __future__ import annotations

import sys
from typing import Any

from perfrun.config import ConfigError, config_dir
from perfrun.console import composition_error, error


def _preflight(args: list[str]) -> str | None:
    """Compose before Hydra does, so that a wrong key or type gets one line, not a page."""
    if any(a.startswith("-") for a in args):
        return None
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="prepare"):
            compose("prepare", overrides=args)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        return composition_error(e, "prepare")
    return None


def _job(cfg: Any) -> None:
    """The Hydra task: prepare, then one line of what was written (or one line of why not)."""
    from rich.console import Console

    from perfrun.prepare.build import Stopped, prepare

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        done = prepare(cfg, console)
    except ConfigError as e:
        error(str(e))
        raise SystemExit(2) from None
    except Stopped as e:
        error(f"stopped by {e}; nothing was written (out={cfg.out} is as it was)")
        raise SystemExit(e.exit_code) from None
    m = done.meta
    if done.not_utf8:
        console.print(f"note: {done.not_utf8} piece(s) of the corpus held bytes that are not UTF-8; they were "
                      "replaced by U+FFFD before tokenising")
    Console(highlight=False, soft_wrap=True).print(
        f"wrote {done.out}: {m.train_tokens:,} train + {m.val_tokens:,} val tokens ({m.dtype}, vocab {m.vocab_size}, "
        f"tokenizer {m.tokenizer}, split by {m.split}) from {m.documents:,} documents in {done.files:,} files "
        f"({done.bytes / 2**20:,.1f} MiB) in {done.seconds:.1f} s: {done.tokens_per_s:,.0f} tokens/s with "
        f"{done.workers} worker(s); train with: perfrun train data=memmap data.path={done.out}"
    )


def main(argv: list[str]) -> int:
    """``perfrun prepare ARGS``: 0 written, 2 a user's mistake, 130/143 stopped by a signal."""
    import hydra

    from perfrun.prepare.schema import register

    register()
    problem = _preflight(argv)
    if problem is not None:
        error(problem)
        return 2
    app = hydra.main(version_base="1.3", config_path=config_dir(), config_name="prepare")(_job)
    saved = sys.argv
    sys.argv = ["perfrun prepare", *argv]
    try:
        app()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
