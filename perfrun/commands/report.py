"""``perfrun report PATH... [--csv | --json | --markdown] [--html FILE] [--plot FILE]``:
paths and flags, so argparse (not Hydra: there is no configuration to compose)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from perfrun.checkpoint.atomic import atomic_write
from perfrun.console import error, warn
from perfrun.ladder.analysis import DEFAULT_LOSS_WINDOW, read_sweep
from perfrun.ladder.plot import report_figure
from perfrun.report.plot import plot_or_warn
from perfrun.report.render import print_report, to_csv, to_html, to_json, to_markdown
from perfrun.report.rows import Report, ReportError
from perfrun.report.spoken import AS_CHOICES

#: a single run's plot (loss and tokens/s over the steps), written into its run dir
RUN_PNG = "report.png"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ReportError(f"{message} (perfrun report --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="perfrun report",
        description="The table and plot of runs, sweeps and tunes after the fact (read from each job's summary.json).",
        epilog="examples:\n  perfrun report outputs/multirun/2025-01-01/12-00-00\n"
               "  perfrun report outputs/multirun/A outputs/multirun/B --html compare.html\n"
               "  perfrun report outputs/multirun/A --csv > runs.csv\n"
               "  perfrun report outputs/2025-01-01/12-00-00   (one run: its table and RUN_DIR/report.png)\n"
               "  perfrun report outputs/multirun/A --as hf   (the verdict as TrainingArguments; lightning, torch, perfrun)\n"
               "A key one run set and another left at its default shows the default's value, read\n"
               "from that run's configuration; a column with no figure in any row is left out.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="run, sweep or tune directories")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV to stdout instead of the table")
    fmt.add_argument("--json", action="store_true", help="print JSON to stdout instead of the table")
    fmt.add_argument("--markdown", action="store_true",
                     help="print Markdown tables (machine named) to stdout, e.g. for a README")
    fmt.add_argument("--as", dest="as_", choices=AS_CHOICES, metavar="{" + ",".join(AS_CHOICES) + "}",
                     help="print the configuration (a run's; a ladder's verdict, or --rung's; a sweep's best job) as "
                          "Python for Hugging Face's Trainer, Lightning or a plain PyTorch loop, or as the perfrun "
                          "train line; each knob with what perfrun measured it to buy (docs/translations.md)")
    p.add_argument("--rung", metavar="NAME", help="with --as on a ladder: this rung's configuration, not the verdict's")
    p.add_argument("--html", metavar="FILE", help="also write a static HTML page (table and embedded plot)")
    p.add_argument("--plot", metavar="FILE",
                   help="also write the PNG plot: tokens/s against each swept key, the ladder, or for a single run its "
                        f"loss and tokens/s over the steps (a single run's plot goes to RUN_DIR/{RUN_PNG} without it)")
    p.add_argument("--loss-window", type=float, default=DEFAULT_LOSS_WINDOW,
                   help=f"ladder loss parity: tail fraction of the logged steps averaged (default {DEFAULT_LOSS_WINDOW})")
    return p


def main(argv: list[str]) -> int:
    """``perfrun report``: 0 on success, 2 on a bad path or option (one line, no traceback)."""
    try:
        args = _parser().parse_intermixed_args(argv)
        if not 0 < args.loss_window <= 1:
            raise ReportError(f"--loss-window {args.loss_window} must be in (0, 1], e.g. 0.2 for the last 20%")
        _check_as(args)
        report = read_sweep(args.paths, loss_window=args.loss_window)
        if report.rows and all(r.status == "unreadable" for r in report.rows):
            raise ReportError("; ".join(f"{r.job}: {r.reason}" for r in report.rows)
                              + ": nothing to report; give a run or sweep dir whose summary.json is intact")
        if args.as_:
            sys.stdout.write(_translated(args, report))
            return 0
        written = _write_files(args, report)
    except ReportError as e:
        error(f"report: {e}")
        return 2
    except OSError as e:
        error(f"report: cannot write {e.filename}: {e.strerror}; choose a writable path")
        return 2
    if args.csv:
        sys.stdout.write(to_csv(report))
    elif args.json:
        sys.stdout.write(to_json(report))
    elif args.markdown:
        sys.stdout.write(to_markdown(report))
    else:
        print_report(report)
    # where the files went; on stderr when stdout carries CSV, JSON or Markdown
    out = sys.stderr if args.csv or args.json or args.markdown else sys.stdout
    for path in written:
        print(f"report: wrote {path}", file=out)
    _resume_hints(args.paths)
    return 0


def _check_as(args: argparse.Namespace) -> None:
    """--as prints one configuration as code and nothing else; --rung only picks it."""
    if args.rung is not None and not args.as_:
        raise ReportError(f"--rung {args.rung} picks the configuration --as translates; add --as hf, lightning, "
                          "torch or perfrun")
    if args.as_ and len(args.paths) > 1:
        raise ReportError(f"--as translates one run or sweep, and {len(args.paths)} paths were given; give one")
    if args.as_ and (args.html or args.plot):
        raise ReportError("--as prints code and writes no file; drop --html and --plot, or run them without --as")


def _translated(args: argparse.Namespace, report: Report) -> str:
    from perfrun.ladder.answer import answer
    from perfrun.ladder.translate import translate

    command = f"perfrun report {args.paths[0]} --as {args.as_}" + (f" --rung {args.rung}" if args.rung else "")
    return translate(answer(report, args.paths[0], args.rung), args.as_, command)


def _write_files(args: argparse.Namespace, report: Report) -> list[Path]:
    """The plot and HTML page asked for, and for a single run its plot beside it (RUN_PNG)
    when no --plot names another place; returns the paths written."""
    single = len(args.paths) == 1 and len(report.rows) == 1
    plot = Path(args.plot) if args.plot else report.paths[report.rows[0].job] / RUN_PNG if single else None
    png = plot_or_warn(report, report_figure) if plot is not None or args.html else None
    written = []
    if plot is not None and png is not None:
        try:
            atomic_write(plot, png)
            written.append(plot)
        except OSError as e:
            if args.plot:
                raise
            warn(f"report: no plot written: cannot write {plot}: {e.strerror}; give --plot FILE to write it elsewhere")
    if args.html:
        from perfrun.ladder.translate import spoken

        report.spoken = spoken(report)
        atomic_write(Path(args.html), to_html(report, png))
        written.append(Path(args.html))
    return written


def _resume_hints(paths: list[str]) -> None:
    """A stopped sweep: the one command that runs the jobs it did not finish."""
    from perfrun.ladder.callback import resume_command, unfinished

    for given in paths:
        left = unfinished(Path(given))
        command = resume_command(Path(given)) if left else None
        if command:
            print(f"{given}: job(s) {', '.join(left)} did not finish; to run what is missing: {command}")
