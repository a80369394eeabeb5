#!/usr/bin/env python3
"""Write docs/bad-inputs.md: every bad input of tests/bad_input_cases.py, run through
perfrun in this process, with the exit code and the one line it printed.

    python scripts/bad_inputs_table.py [--out docs/bad-inputs.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from perfrun.checkpoint import files as checkpoint  # noqa: E402
from perfrun.commands.dispatch import main as cli_main  # noqa: E402

from bad_input_cases import CASES, SMALL, make_fixtures  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bad-inputs.md")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        os.chdir(d)
        cli_main(["train", *SMALL, "model.n_embd=64", "hydra.run.dir=source", "progress=off"])
        cli_main(["train", *SMALL, "hydra.run.dir=small", "progress=off"])
        make_fixtures(d, checkpoint.list_checkpoints(d / "source" / "checkpoints")[-1],
                      checkpoint.list_checkpoints(d / "small" / "checkpoints")[-1])
        for case in CASES:
            given = [a.format(d=d) for a in case.args]
            argv = [given[0], *(SMALL if case.small else []), *given[1:]]
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    rc = cli_main(argv)
                except SystemExit as e:
                    rc = e.code
            line = " ".join(err.getvalue().split()).replace(str(d), "DIR")
            shown = " ".join(a.replace(str(d), "DIR") for a in given)
            rows.append((case.what, shown, rc, line))
    out = [
        "# Bad inputs and what perfrun answers",
        "",
        "Each row was produced by `python scripts/bad_inputs_table.py`, which runs the command",
        "(with a small model appended: see `tests/bad_input_cases.py`) and records the exit code",
        "and the one line perfrun printed. `tests/test_reliability.py::test_bad_input_gets_one_line`",
        "checks every row: non-zero exit, one line naming the input and the fix, no traceback,",
        "no file changed. `DIR` stands for the folder holding the test files.",
        "",
        "| # | mistake | command | exit | what perfrun prints |",
        "|---|---|---|---|---|",
    ]
    for i, (what, shown, rc, line) in enumerate(rows, 1):
        out.append(f"| {i} | {what} | `perfrun {shown}` | {rc} | {line.replace('|', '/')} |")
    out += [
        "",
        "Also covered by tests, outside this table (they need a simulated fault):",
        "a full disk during a checkpoint save (`test_full_disk_during_save_keeps_the_previous_checkpoint`),",
        "fp16 on a device without it (`test_fp16_where_unsupported_is_refused`), `compile=true`",
        "without a C++ compiler (`test_compile_without_a_compiler_is_refused`), and out of memory",
        "(`test_out_of_memory_becomes_advice`). In `tests/test_nothing_lost.py`: a real full disk (a 2 MiB",
        "tmpfs) as checkpoint.dir, as hydra.run.dir and as an export target, a second job in a run dir",
        "that another holds, an unexpected exception in a job and in a sweep's job, and a refused",
        "command on a completed run. In `tests/test_refusals.py`: a `sys.exit` in a user's model (in `__init__`",
        "and in its forward) leaves a `failed` summary.json, never `running`, and a module that parses the",
        "command line at import sees none of perfrun's (and, in a real process, one that exits on it is one",
        "line). In `tests/test_estimate.py`: a CPU run whose estimate is beyond this machine's available memory",
        "is refused before anything is allocated (a shape of 206 billion parameters, estimated under fake",
        "tensors), and on a GPU the same estimate is a warning naming the knob that fits.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out))
    print(f"wrote {args.out} ({len(rows)} bad inputs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
