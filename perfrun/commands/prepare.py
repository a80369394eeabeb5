"""``perfrun prepare path=CORPUS out=DIR tokenizer=...``: a corpus of text files and
``.jsonl`` documents to the ``train.bin``/``val.bin`` token files that ``data=memmap``
reads, with a ``meta.json`` that records the tokenizer and the vocabulary.

A Hydra app like ``perfrun generate`` and ``perfrun export``
(:class:`perfrun.commands.hydra_app.HydraCommand`): the keys are typed by
:class:`perfrun.prepare.schema.PrepareConfig` and composed from conf/prepare.yaml, so
``--help`` lists them, ``--cfg job`` prints the configuration and a wrong key or type is
one line. The work is in :mod:`perfrun.prepare.build` (writing, atomically) and
:mod:`perfrun.prepare.corpus` (reading and tokenising, in worker processes).
"""

from __future__ import annotations

from perfrun.commands.hydra_app import HydraCommand
from perfrun.config import ConfigError
from perfrun.console import error
from perfrun.prepare.schema import PrepareConfig


def run(cfg: PrepareConfig) -> int:
    """The job: prepare, then one line of what was written (or one line of why not);
    0 written, 2 a user's mistake, 130/143 stopped by a signal."""
    from rich.console import Console

    from perfrun.prepare.build import Stopped, prepare

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        done = prepare(cfg, console)
    except ConfigError as e:
        error(str(e))
        return 2
    except Stopped as e:
        error(f"stopped by {e}; nothing was written (out={cfg.out} is as it was)")
        return e.exit_code
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
    return 0


COMMAND = HydraCommand("prepare", PrepareConfig, run)


def main(argv: list[str]) -> int:
    """``perfrun prepare KEY=VALUE...``: 0 written, 2 a user's mistake, 130/143 stopped by a signal."""
    return COMMAND.main(argv)
