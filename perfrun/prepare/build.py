"""``perfrun prepare``'s work: tokenise the corpus over worker processes, write the token
files into a hidden folder beside ``out`` and rename it into place only when every file
is complete, so that a stopped or killed prepare leaves nothing that training would read.

A folder written by an earlier prepare is replaced whole (it is renamed aside, the new one
renamed in, then the old one removed); any other non-empty folder is refused, so nothing
of the user's is lost. Temporary folders of a prepare that was killed are removed by the
next prepare into the same place.
"""

from __future__ import annotations

import glob
import math
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

import perfrun.prepare.corpus as corpus
from perfrun.checkpoint.atomic import fsync_dir
from perfrun.config import ConfigError
from perfrun.data.files import corpus_files
from perfrun.data.meta import META_NAME, TokenMeta, dtype_for, read_meta, write_meta
from perfrun.data.tokenizers import EOT_NAMES, Tokenizer, load_tokenizer
from perfrun.prepare.schema import PrepareConfig, validate

OURS = ("train.bin", "val.bin", META_NAME, "tokenizer.json")


class Stopped(Exception):
    """SIGINT or SIGTERM during the work: the temporary folder is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


@dataclass
class Prepared:
    out: Path
    meta: TokenMeta
    files: int
    bytes: int
    seconds: float
    workers: int
    not_utf8: int  # tasks that held bytes that are not UTF-8

    @property
    def tokens_per_s(self) -> float:
        return (self.meta.train_tokens + self.meta.val_tokens) / max(self.seconds, 1e-9)


class TokensPerSecond(ProgressColumn):
    """Tokens written so far over the time taken, from the task's ``tokens`` field."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        rate = task.fields.get("tokens", 0) / elapsed if elapsed else 0.0
        return Text(f"{rate:,.0f} tokens/s", style="progress.data.speed")


def _check_out(out: Path, shown: str) -> None:
    """``out`` may be new, empty, or an earlier prepare's folder (holding only its files)."""
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    foreign = [n for n in names if n not in OURS]
    try:
        ours = read_meta(out) is not None
    except ConfigError:  # perfrun's meta file, damaged: still perfrun's folder
        ours = True
    if foreign or not ours:
        which = f" ({', '.join(foreign[:3])}{'...' if len(foreign) > 3 else ''})" if foreign else ""
        raise ConfigError(f"{shown} holds files that perfrun prepare did not write{which}; choose a new or empty "
                          "folder, so that nothing of yours is replaced")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path, name: str) -> None:
    """Temporary folders of killed prepares into ``parent/name`` (their process is gone)."""
    for p in parent.glob(f".{glob.escape(name)}.*.tmp"):
        pid = p.name.removeprefix(f".{name}.").split(".", 1)[0].split("-")[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A hidden folder beside ``out`` to write into; renamed to ``out`` if the block ends
    normally, removed whatever happens."""
    parent = out.absolute().parent
    made = next((p for p in reversed([parent, *parent.parents]) if not p.exists()), None)
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, out.name)
    tmp = parent / f".{out.name}.prepare-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = parent / f".{out.name}.old-{os.getpid()}.tmp"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_dir(parent)
        made = None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made is not None:  # the folders made for out, when nothing was published into them
            shutil.rmtree(made, ignore_errors=True)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` in this process (workers ignore SIGINT)."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


STOPS = {signal.SIGINT, signal.SIGTERM}


def _pool_worker(settings: corpus.Settings) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the main process decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's handler: the pool ends workers so
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # a SIGTERM sent before this line ends the worker here
    corpus.start_worker(settings)


@contextmanager
def worker_pool(settings: corpus.Settings, workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A pool whose workers are forked with SIGINT and SIGTERM blocked until they have set
    their own handlers. Forked unblocked, a worker held the parent's Python handler until it
    first ran, and a SIGTERM delivered then was dropped (CPython clears a signal caught in the
    child before fork returns): the pool ends its workers as soon as the work is done, which
    on a busy machine can come before a worker has run at all, and that worker then waited
    for work forever, and the pool's exit with it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:  # the pool's own threads start here too: they keep the stop signals blocked, as they should
        pool = multiprocessing.get_context().Pool(workers, initializer=_pool_worker, initargs=(settings,))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        raise
    with pool:  # unblocked inside: a stop signal that came meanwhile is raised here, and ends the pool too
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        yield pool


def _encoded(tasks: list[corpus.Task], settings: corpus.Settings, workers: int) -> Iterator[corpus.Encoded]:
    """Each task's tokens, in task order (so the output does not depend on ``workers``)."""
    if workers == 1:
        corpus.start_worker(settings)
        yield from map(corpus.encode, tasks)
        return
    with worker_pool(settings, workers) as pool:
        yield from pool.imap(corpus.encode, tasks, chunksize=1)


def _write(tmp: Path, tasks: list[corpus.Task], settings: corpus.Settings, workers: int,
           progress: bool) -> tuple[int, int, int, int]:
    """train.bin and val.bin; returns (train tokens, val tokens, documents, non-UTF-8 tasks)."""
    columns = [TextColumn("prepare"), BarColumn(), DownloadColumn(), TokensPerSecond(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn()]
    n_train = n_val = documents = not_utf8 = 0
    total = sum(p.hi - p.lo for task in tasks for p in task)
    console = Console(stderr=True)
    with (open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val,
          Progress(*columns, console=console, disable=not (progress and console.is_terminal), transient=True) as bar):
        job = bar.add_task("prepare", total=total, tokens=0)
        for enc in _encoded(tasks, settings, workers):
            train.write(enc.train.tobytes())
            val.write(enc.val.tobytes())
            n_train, n_val = n_train + enc.train.size, n_val + enc.val.size
            documents, not_utf8 = documents + enc.documents, not_utf8 + enc.not_utf8
            bar.update(job, advance=enc.bytes, tokens=n_train + n_val)
        for f in (train, val):
            f.flush()
            os.fsync(f.fileno())
    return n_train, n_val, documents, not_utf8


def _split_stream(tmp: Path, n: int, val_fraction: float, itemsize: int) -> tuple[int, int]:
    """The last ``val_fraction`` of train.bin's tokens become val.bin."""
    n_val = int(round(n * val_fraction))
    with open(tmp / "train.bin", "rb+") as train, open(tmp / "val.bin", "wb") as val:
        train.seek((n - n_val) * itemsize)
        shutil.copyfileobj(train, val)
        train.truncate((n - n_val) * itemsize)
        for f in (train, val):
            f.flush()
            os.fsync(f.fileno())
    return n - n_val, n_val


def _tokenizer_in_folder(tok: Tokenizer, tmp: Path) -> str:
    """The tokenizer as meta.json records it: a tokenizer file is copied into the folder,
    so the folder carries what made its ids wherever it is moved."""
    if tok.name == "byte" or tok.name.startswith("tiktoken:"):
        return tok.name
    shutil.copyfile(tok.name, tmp / "tokenizer.json")
    return "tokenizer.json"


def prepare(cfg: PrepareConfig, console: Console) -> Prepared:
    """Tokenise ``cfg.path`` into ``cfg.out``; bad input raises a one-line ConfigError."""
    t0 = time.perf_counter()
    path, out = validate(cfg)
    files = corpus_files(path, f"path={cfg.path}")
    tok = load_tokenizer(cfg.tokenizer)
    _check_out(out, f"out={cfg.out}")
    tasks, n_docs = corpus.plan(files)
    by_document = math.floor(n_docs * cfg.val_fraction) >= 1
    settings = corpus.Settings(tok.name, dtype_for(tok.vocab_size), float(cfg.val_fraction), by_document,
                               str(cfg.text_field))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(cfg.workers or cores, len(tasks)))
    if tok.eot_id is None and tok.name != "byte":
        console.print(f"note: {tok.name} has no end-of-text token ({', '.join(EOT_NAMES)}), so documents follow "
                      "each other with no separator")
    with stop_on_signals(), staging(out) as tmp:
        n_train, n_val, documents, not_utf8 = _write(tmp, tasks, settings, workers, bool(cfg.progress))
        if not by_document:
            n_train, n_val = _split_stream(tmp, n_train, cfg.val_fraction, np.dtype(settings.dtype).itemsize)
        if min(n_train, n_val) < 2:
            raise ConfigError(f"path={cfg.path} gives {n_train} train and {n_val} val tokens; training needs more than "
                              "one in each: use a larger corpus (or another val_fraction)")
        meta = TokenMeta(tokenizer=_tokenizer_in_folder(tok, tmp), vocab_size=tok.vocab_size, eot_id=tok.eot_id,
                         dtype=settings.dtype, train_tokens=n_train, val_tokens=n_val, documents=documents,
                         source=str(path.resolve()), val_fraction=float(cfg.val_fraction),
                         split="documents" if by_document else "stream")
        write_meta(tmp, meta)
    return Prepared(out, meta, len(files), sum(s for _, s in files), time.perf_counter() - t0, workers, not_utf8)
