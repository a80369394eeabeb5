"""One job per folder, and what a job keeps of the runs before it in its run dir.

A job holds an exclusive ``fcntl.flock`` on ``.perfrun.lock`` in its run dir (and in
``checkpoint.dir``) for its whole life; the file holds the holder's pid, so a second job is
told whose it is. The kernel releases a flock when its holder dies, even by ``kill -9``, so a
stale lock is simply taken over (and said so: the file still names the dead pid, since a job
that ends normally empties it). Once the lock is held, the temporary files that a killed
write left (``atomic_write``'s ``.NAME.XXXX.tmp``) are removed: no other job can be writing them.

:class:`RunRecord` keeps a finished result: a job refused before its first step writes no
summary over the one already there, and a job that does train into a run dir carries the
previous summaries on in ``history``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from perfrun.checkpoint.atomic import atomic_write
from perfrun.config import ConfigError
from perfrun.summary import SUMMARY_FILE, RunSummary, read_summary

log = logging.getLogger("perfrun")

LOCK_FILE = ".perfrun.lock"
TEMP_FILE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # tempfile.mkstemp(prefix=".NAME.", suffix=".tmp")
_held: dict[Path, int] = {}  # folder -> the lock file's descriptor, in this process


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def holder(folder: Path) -> int | None:
    """The pid of the job that holds ``folder``'s lock now, or None when it is free."""
    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _pid_in(fd) or -1
    finally:
        os.close(fd)


@contextmanager
def locked(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder`` (``what``: the setting that named it) for the life of the block;
    re-entrant within one process. Raises ConfigError, naming the holder, when another
    job holds it."""
    folder = Path(folder).absolute()
    if folder in _held:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _pid_in(fd)
        os.close(fd)
        raise ConfigError(
            f"{what}={folder} is in use by another perfrun job (pid {pid if pid else 'unknown'}); wait for it to end "
            f"or stop it, or choose another {what}"
        ) from None
    stale = _pid_in(fd)
    if stale is not None and stale != os.getpid():
        log.warning(f"{what}={folder}: took over the lock of pid {stale}, which ended without releasing it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[folder] = fd
    try:
        remove_temp_files(folder)
        yield
    finally:
        del _held[folder]
        os.ftruncate(fd, 0)  # an empty file: released, not abandoned
        os.close(fd)


def remove_temp_files(folder: Path) -> list[Path]:
    """Remove what a killed atomic write left in ``folder`` (only while its lock is held)."""
    removed = [p for p in Path(folder).iterdir() if p.is_file() and TEMP_FILE.match(p.name)]
    for p in removed:
        p.unlink(missing_ok=True)
    if removed:
        log.info(f"removed {len(removed)} temporary file(s) left by an interrupted write in {folder}")
    return removed


@contextmanager
def undone_if_refused(run_dir: Path) -> Iterator[None]:
    """Hydra writes ``.hydra/*.yaml`` and appends to ``train.log`` before a job can be refused.
    Where a run already stands (a summary, or another job holding the lock) and this job
    writes no summary (it was refused), its Hydra files are put back as they were, and the
    log cut back to its length unless the other job is still writing it."""
    run_dir = Path(run_dir)
    summary = run_dir / SUMMARY_FILE
    if not summary.is_file() and holder(run_dir) is None:
        yield
        return
    before = summary.stat().st_mtime_ns if summary.is_file() else None
    kept = {p: p.read_bytes() for p in (run_dir / ".hydra").glob("*.yaml")}
    logs = {p: p.stat().st_size for p in run_dir.glob("*.log")}
    try:
        yield
    finally:
        after = summary.stat().st_mtime_ns if summary.is_file() else None
        if after == before:
            _put_back(run_dir, kept, logs)


def _put_back(run_dir: Path, kept: dict[Path, bytes], logs: dict[Path, int]) -> None:
    """The Hydra files and logs as they were: new ones removed, the others restored."""
    hydra = run_dir / ".hydra"
    for p in hydra.glob("*.yaml"):
        if p not in kept:
            p.unlink()
    for p, data in kept.items():
        atomic_write(p, data)
    if hydra.is_dir() and not any(hydra.iterdir()):
        hydra.rmdir()
    if holder(run_dir) is None:  # else the other job is still writing its log
        for p in run_dir.glob("*.log"):
            if p in logs:
                os.truncate(p, logs[p])
            else:
                p.unlink()


class RunRecord:
    """The summary already in a run dir (if any), and what this job may write over it."""

    def __init__(self, run_dir: Path | None) -> None:
        self.previous: RunSummary | None = None
        self.owned = False  # set once the run dir's lock is held: before that it may be another job's
        self.trained = False  # set once the first step may run: from then on the job's own summary stands
        if run_dir is not None and (Path(run_dir) / SUMMARY_FILE).is_file():
            try:
                self.previous = read_summary(run_dir)
            except (OSError, ValueError):
                self.previous = None  # unreadable: nothing to keep

    def to_write(self, summary: RunSummary) -> RunSummary | None:
        """The summary to write, with the earlier ones under ``history``; None when the job
        was refused before training and the run dir already holds a summary, or is another job's."""
        if not self.owned:
            return None
        if self.previous is None:
            return summary
        if not self.trained:
            return None
        earlier: list[Any] = list(self.previous.get("history") or [])
        earlier.append({k: v for k, v in self.previous.items() if k != "history"})
        return {**summary, "history": earlier}
