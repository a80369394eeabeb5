"""perfrun's cache folder: token files built once (pysource) and the verdicts of checks that
read whole files (the largest token id of a .bin), so that the work is done once per file.

A verdict is keyed by the file's path, size, inode and modification time: a file that is
rewritten, even in place, is checked again. Everything here is written atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from perfrun.checkpoint.atomic import atomic_write
from perfrun.config import DataConfig

STALE_TEMP_S = 3600  # a temporary file this old is litter from a process killed mid-write


def cache_root(cfg: DataConfig) -> Path:
    """``data.cache_dir``, else ``$PERFRUN_CACHE``, else ``~/.cache/perfrun``."""
    root = getattr(cfg, "cache_dir", None) or os.environ.get("PERFRUN_CACHE") or "~/.cache/perfrun"
    return Path(str(root)).expanduser()


def remove_stale_temps(folder: Path) -> None:
    """Remove temporary files left by a run killed mid-write (SIGKILL skips cleanup)."""
    for stale in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
                stale.unlink()


def file_key(path: Path, **extra: Any) -> dict[str, Any]:
    """What identifies one version of a file: its path, size, inode and mtime (+ ``extra``)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "inode": st.st_ino,
            "mtime_ns": st.st_mtime_ns, **extra}


def _verdict_path(root: Path, kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return root / kind / f"{digest}.json"


def read_verdict(root: Path, kind: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict recorded for exactly this ``key``, or None."""
    try:
        record = json.loads(_verdict_path(root, kind, key).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def write_verdict(root: Path, kind: str, key: dict[str, Any], verdict: dict[str, Any]) -> None:
    """Record ``verdict`` for ``key`` (raises OSError when the cache cannot be written)."""
    atomic_write(_verdict_path(root, kind, key), json.dumps({"key": key, **verdict}, indent=1))
