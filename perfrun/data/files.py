"""The files of a text corpus (a file or a folder), as ``data=text`` and ``perfrun prepare``
read them: hidden files and folders skipped, empty files dropped, the rest checked readable."""

from __future__ import annotations

import os
from pathlib import Path

from perfrun.config import ConfigError


def list_files(root: Path) -> list[Path]:
    """Regular, non-hidden files below ``root`` (hidden folders skipped too), sorted."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            p = Path(dirpath, fn)
            if not fn.startswith(".") and p.is_file():
                out.append(p)
    return sorted(out, key=lambda q: q.relative_to(root).as_posix())


def corpus_files(p: Path, shown: str) -> list[tuple[Path, int]]:
    """(file, size) of every non-empty, readable file of a text corpus (a file or a folder);
    ``shown`` (e.g. ``data.path=...``) names it in the one-line error when there is none."""
    if p.is_dir():
        files = list_files(p)
        if not files:
            raise ConfigError(
                f"{shown} is a folder with no files (hidden files are skipped); "
                f"put text files in it or point {shown.split('=')[0]} at a file"
            )
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"{shown} is neither a regular file nor a folder; point it at text")
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) == 0:
        what = "is empty (0 bytes)" if p.is_file() else f"holds only empty files ({len(files)})"
        raise ConfigError(f"{shown} {what}; point {shown.split('=')[0]} at text with content")
    kept = [(f, s) for f, s in zip(files, sizes, strict=True) if s > 0]
    for f, _ in kept:
        try:
            with open(f, "rb"):
                pass
        except OSError as e:
            raise ConfigError(
                f"{shown}: cannot read {f} ({e.strerror}); fix its permissions or remove it"
            ) from None
    return kept
