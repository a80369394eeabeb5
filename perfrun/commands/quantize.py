"""``python -m perfrun.commands.quantize checkpoint=PATH [val_batches=N] [batch_size=B] [gen_tokens=N]
[include_head=false] [json=false]``: the int8 report, as ``perfrun export format=int8-report``
with those keys under ``int8.`` (the measurement itself is :mod:`perfrun.inference.int8`)."""

from __future__ import annotations

import sys

from perfrun.commands import export

OPTIONS = ("val_batches", "batch_size", "gen_tokens", "include_head", "json")


def main(argv: list[str]) -> int:
    """The int8 report's exit code (0 measured, 1 int8 loss not finite, 2 a user's mistake)."""
    words = [f"int8.{w}" if w.partition("=")[0] in OPTIONS else w for w in argv]
    return export.main(["format=int8-report", *words])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
