"""Which files and folders in a checkpoint folder are complete checkpoints, by name alone.

Apart from :mod:`perfrun.checkpoint.files` because it needs no torch: the launcher of a
multi-rank run looks for the run that ``resume=auto`` continues before it starts torchrun,
and importing torch only to list a folder would cost it two seconds of start-up.
"""

from __future__ import annotations

import re
from pathlib import Path

NAME = re.compile(r"^step_(\d+)(\.pt)?$")
META = "meta.pt"  # in a sharded checkpoint folder: everything but the model and optimizer


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder`` (files and sharded folders), oldest first;
    temporary files and folders cut short are ignored."""
    if not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p.stat().st_mtime, p) for p in Path(folder).iterdir()
             if (m := NAME.match(p.name)) and (p.is_file() if m.group(2) else is_sharded(p))]
    return [p for *_, p in sorted(found)]  # a step in both layouts (a reused run dir): the newer last
