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
