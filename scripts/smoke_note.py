#!/usr/bin/env python3
"""One line from a finished run for scripts/gpu_bench.sh smoke's table: the named summary.json
keys (dotted: ``knobs.fp8.kept_in_bf16``) and whether the named files exist.

    python scripts/smoke_note.py RUN_DIR KEY_OR_FILE ...     (a FILE is given as file:GLOB)

Prints ``key=value; ...``; a key the summary lacks prints ``key=absent`` (so the table shows
it, rather than the row failing), a file glob ``GLOB: N files, B bytes``. Exit 2 when RUN_DIR
has no readable summary.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MISSING = object()


def dotted(summary: dict[str, Any], key: str) -> Any:
    node: Any = summary
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 160 else text[:157] + "..."


def note(run_dir: Path, items: list[str]) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    parts = [f"status={summary.get('status')}"]
    for item in items:
        if item.startswith("file:"):
            files = [p for p in run_dir.glob(item[5:]) if p.is_file()]
            parts.append(f"{item[5:]}: {len(files)} files, {sum(p.stat().st_size for p in files):,} bytes")
        else:
            value = dotted(summary, item)
            parts.append(f"{item}={'absent' if value is MISSING else short(value)}")
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    try:
        print(note(Path(argv[0]), argv[1:]))
    except (OSError, ValueError) as e:
        print(f"smoke_note.py: no readable summary.json in {argv[0]}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
