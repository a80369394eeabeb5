"""All-or-nothing file writes: a temporary file beside the target, flushed and fsynced,
then renamed over it, so a crash (even ``kill -9``) never leaves a half-written file
where a good one was. The folder is fsynced too, so the rename survives a power cut."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from perfrun.config import ConfigError


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview | str | Callable[[IO[bytes]], None]) -> Path:
    """Write ``data`` (bytes, text, or a function that writes into the open binary file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:  # an interruption too: never leave the temporary file behind
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def check_out_file(path: Path, key: str, example: str = "out.json") -> None:
    """Refuse, before any work, a file a command was asked to write that it cannot or must not:
    a folder, a file under a folder that does not exist, a folder that is not writable, or a
    read-only file. Read-only is the file's own mode (no write bit), not only this process's
    access to it: ``chmod a-w`` protects a file from perfrun even when it runs as root."""
    if path.is_dir():
        raise ConfigError(f"{key}={path} is a folder; give a file name, such as {key}={path / example}")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{key}={path}: its folder {folder} does not exist; create it (mkdir -p {folder}) "
                          f"or choose another {key}")
    if path.exists() and (not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222):
        raise ConfigError(f"{key}={path} is read-only, so perfrun does not replace it; choose another {key}, "
                          f"or make it writable (chmod u+w {path})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: its folder {folder} is not writable; choose another {key}")


def json_safe(obj: Any) -> Any:
    """JSON has no NaN or infinity: they become null (strict parsers reject them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> Path:
    """summary.json and friends: indented, NaN-free, all or nothing."""
    return atomic_write(path, json.dumps(json_safe(obj), indent=2, default=str) + "\n")
