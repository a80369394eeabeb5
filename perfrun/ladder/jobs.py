"""What ``perfrun train -m`` does around Hydra's sweep: one line for a sweep that cannot be
composed, a ``+sweep=`` preset without ``-m``, a stopped sweep that keeps what it measured
(its summary written, the command that finishes it printed), and on ``resume=auto`` the jobs
already measured left as they are."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from perfrun.console import composition_error
from perfrun.ladder.callback import resume_command

if TYPE_CHECKING:
    from omegaconf import DictConfig

STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def preset_without_multirun(args: list[str]) -> str | None:
    """``+sweep=ablation`` without ``-m`` would run one plain job: refuse it in one line."""
    preset = next((a for a in args if _key(a) == "sweep" and "=" in a), None)
    if preset is None or any(a.startswith("-") for a in args):  # --cfg, --help, --info: no job runs
        return None
    return (f"{preset} is a sweep of many jobs, run only with -m; add -m: perfrun train -m {preset} "
            + " ".join(a for a in args if a != preset)).rstrip()


def override_grammar(args: list[str]) -> str | None:
    """An override Hydra's grammar cannot read (a quote, a space, a non-ASCII letter, a
    stray bracket): one line naming it and how to write it, not the lexer's name for it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    for arg in (a for a in args if not a.startswith("-") and "=" in a):  # not a flag, nor a flag's value
        try:
            OverridesParser.create().parse_overrides([arg])
        except OverrideParseException:
            key = arg.split("=", 1)[0]
            return (f"{arg}: the override grammar cannot read this value (it refuses quotes, spaces, non-ASCII "
                    f"letters and characters such as [ ] = : outside a quoted string); quote it as {key}='\"...\"' "
                    "or choose a plain name (letters, digits, - _ . /)")
        except Exception:  # noqa: BLE001 - anything else about the override: the composition reports it
            return None
    return None


def preflight(args: list[str]) -> tuple[str | None, DictConfig | None]:
    """Compose the sweep's first job before Hydra does (and check every ``+ablation=`` rung
    name), so that a wrong rung, key or type is one line instead of Hydra's page: the
    problem, else None and that job's ``hydra`` node (the sweep's folders, read from it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from perfrun.config import config_dir

    given = [a for a in args if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception as e:  # noqa: BLE001 - the override grammar: Hydra's own message, first line
        return composition_error(e), None
    first = []
    rungs = sorted(p.stem for p in (Path(config_dir()) / "ablation").glob("*.yaml"))
    for o in parsed:
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if o.key_or_group == "ablation":
            unknown = [v for v in values if v not in rungs]
            if unknown:
                return (f"+ablation={','.join(unknown)}: no such rung; choose among {', '.join(rungs)} "
                        "(conf/ablation/)"), None
        first.append(f"{o.input_line.split('=', 1)[0]}={values[0]}" if values else o.input_line)
    if any(_key(a) == "sweep" for a in given) and not any(_key(a) == "ablation" for a in given):
        first.append("+ablation=naive")
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            composed = compose("train", overrides=first, return_hydra_config=True)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's input
        return composition_error(e), None
    return None, composed.hydra


def already_measured(run_dir: Path, overrides: list[str]) -> str | None:
    """On ``resume=auto``: the status of a job this sweep dir already holds complete (or
    skipped) with the same overrides, which is then not run again; None to run it."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None

    def same(o: list[str]) -> list[str]:
        return [x for x in o if _key(x) != "resume"]

    status = summary.get("status")
    if status in ("completed", "skipped") and same(list(summary.get("overrides") or [])) == same(overrides):
        return str(status)
    return None


@contextlib.contextmanager
def stops_cleanly(sweep_dir: str | None) -> Iterator[None]:
    """Around the sweep: SIGTERM between jobs stops it like Ctrl-C (a job in progress has its
    own handler, which finishes the step); on either, the sweep's summary is written for the
    jobs that finished, and the command that runs the rest is printed."""
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous: Any = signal.signal(signal.SIGTERM, on_term) if sweep_dir is not None else None
    try:
        yield
    except KeyboardInterrupt:
        if sweep_dir is not None:
            _keep(Path(sweep_dir), 128 + signal.SIGINT)
        raise SystemExit(128 + signal.SIGINT) from None
    except SystemExit as e:
        if sweep_dir is not None and e.code in STOP_CODES:
            _keep(Path(sweep_dir), int(e.code))
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _keep(sweep_dir: Path, code: int) -> None:
    """The summary of what the stopped sweep measured, and how to finish it."""
    from perfrun.console import error, warn
    from perfrun.ladder.sweep_files import write_sweep_summary
    from perfrun.report import ReportError

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # writing the summary is not interrupted again
    try:
        write_sweep_summary(sweep_dir)
        written = f"its summary is in {sweep_dir / 'sweep_summary.json'}"
    except ReportError as e:
        written = f"no summary ({e})"
    except Exception as e:  # noqa: BLE001 - never lose the jobs' results to a summary bug
        warn(f"no sweep summary ({type(e).__name__}: {e}); the jobs' results are in {sweep_dir}")
        written = "no summary"
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    command = resume_command(sweep_dir)
    error(f"the sweep was stopped by {signal.Signals(code - 128).name}: {written}; "
          + (f"to run the jobs it did not finish: {command}" if command else "rerun it with resume=auto"))
