#!/usr/bin/env python3
"""Two runs of the same ladder, rung by rung: how far each rung's median tokens/s moved.

    python scripts/compare_ladders.py SWEEP_A SWEEP_B [--goal PCT] [--json FILE]

SWEEP_A and SWEEP_B are the folders of two ``perfrun train -m +sweep=ablation`` runs with the
same overrides (or their ``sweep_summary.json``). The rungs are read from the files, never
named here: the ladder, the alternatives (fp16) and the leave-one-out jobs, in A's order, then
any rung only B has. For each: both medians and the move (B - A) / A in %; a rung that was not
measured in one run (not applicable on the device, every job contended or failed) shows n/a.
The last line counts the rungs that moved less than ``--goal`` % (3 on a GPU, 5 on a quiet
CPU is what the ladder aims at): how reproducible one ladder's figures are on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perfrun.checkpoint.atomic import write_json  # noqa: E402
from perfrun.console import error, first_line  # noqa: E402
from perfrun.ladder.sweep_files import SWEEP_JSON  # noqa: E402

#: the parts of sweep_summary.json whose entries are rungs with a tokens/s median
PARTS = ("ladder", "alternatives", "leave_one_out")


class LadderError(ValueError):
    """A path that holds no ladder: said in one line."""


def read_ladder(path: Path) -> dict[str, Any]:
    """The one ladder of a sweep folder or sweep_summary.json (its parts by name)."""
    file = path / SWEEP_JSON if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise LadderError(f"cannot read {file}: {first_line(exc)}; give the folder of a finished "
                          f"perfrun train -m +sweep=ablation run") from exc
    except ValueError as exc:
        raise LadderError(f"{file} is not JSON ({first_line(exc)}); it should be the {SWEEP_JSON} a sweep wrote") from exc
    ladders = data.get("ablation") if isinstance(data, dict) else None
    if isinstance(ladders, list) and len(ladders) > 1:
        raise LadderError(f"{file} holds {len(ladders)} ladders; compare the sweep folders of one ladder each")
    one = ladders[0] if isinstance(ladders, list) and ladders else data
    if not isinstance(one, dict) or not isinstance(one.get("ladder"), list):
        raise LadderError(f"{file} has no ladder; it comes from perfrun train -m +sweep=ablation, not another sweep")
    return one


def rungs(ladder: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rung name -> its entry (with the part it came from), in the file's order."""
    out: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        for e in ladder.get(part) or []:
            out[e["rung"]] = {**e, "part": part}
    return out


def _measured(e: dict[str, Any] | None) -> float | None:
    if not e or e.get("applicable") is False:
        return None
    v = e.get("tokens_per_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def compare(a: dict[str, Any], b: dict[str, Any], goal_pct: float) -> list[dict[str, Any]]:
    """One row per rung of either run: both medians, the move in %, and whether it is within the goal."""
    ra, rb = rungs(a), rungs(b)
    rows = []
    for name in [*ra, *(n for n in rb if n not in ra)]:
        ea, eb = ra.get(name), rb.get(name)
        ta, tb = _measured(ea), _measured(eb)
        moved = 100.0 * (tb - ta) / ta if ta is not None and tb is not None else None
        rows.append({"rung": name, "part": (ea or eb or {}).get("part"), "a": ta, "b": tb,
                     "a_spread_pct": (ea or {}).get("spread_pct"), "b_spread_pct": (eb or {}).get("spread_pct"),
                     "moved_pct": moved, "within_goal": None if moved is None else abs(moved) <= goal_pct,
                     "why_not": None if moved is not None else _why_not(name, ea, eb)})
    return rows


def _why_not(name: str, ea: dict[str, Any] | None, eb: dict[str, Any] | None) -> str:
    if ea is None or eb is None:
        return f"only in run {'B' if ea is None else 'A'}"
    e = ea if _measured(ea) is None else eb
    return e.get("verdict") or "not measured"


def _num(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]], goal_pct: float, names: tuple[str, str]) -> str:
    """The table and the closing line; returns the closing line (what the digest keeps)."""
    print(f"A: {names[0]}\nB: {names[1]}")
    print(f"{'rung':<28} {'part':<13} {'A tok/s':>12} {'B tok/s':>12} {'moved':>8}  within ±{goal_pct:g}%")
    for r in rows:
        ok = "" if r["within_goal"] is None else "yes" if r["within_goal"] else "NO"
        moved = _num(r["moved_pct"], "+.1f") + ("%" if r["moved_pct"] is not None else "")
        print(f"{r['rung']:<28} {r['part'] or '':<13} {_num(r['a'], ',.0f'):>12} {_num(r['b'], ',.0f'):>12} "
              f"{moved:>8}  {ok or r['why_not']}")
    compared = [r for r in rows if r["moved_pct"] is not None]
    if not compared:
        line = "ladder reproducibility: no rung was measured in both runs"
    else:
        worst = max(compared, key=lambda r: abs(r["moved_pct"]))
        inside = sum(1 for r in compared if r["within_goal"])
        line = (f"ladder reproducibility: {inside} of {len(compared)} rungs moved less than ±{goal_pct:g}% between "
                f"the two runs; the largest move {worst['moved_pct']:+.1f}% ({worst['rung']})")
    print(line)
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="the first run's sweep folder (or its sweep_summary.json)")
    ap.add_argument("b", type=Path, help="the second run's")
    ap.add_argument("--goal", type=float, default=3.0, help="the move, in %%, a reproducible rung stays within")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.goal <= 0:
        error(f"--goal {args.goal:g} must be a percentage above 0 (3 on a GPU, 5 on a CPU)")
        return 2
    try:
        a, b = read_ladder(args.a), read_ladder(args.b)
    except LadderError as exc:
        error(str(exc))
        return 2
    rows = compare(a, b, args.goal)
    line = print_table(rows, args.goal, (str(args.a), str(args.b)))
    if args.json:
        write_json(args.json, {"goal_pct": args.goal, "rows": rows, "line": line})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
