"""The one console: error and warning lines, the wide console for tables, the
formatter that turns an exception into the one line a user reads, the one that
prints a figure that may be missing, text quoted for Hydra's override grammar, and the
root logger kept as it was around a Hydra app run in the caller's process.

Every command prints its errors through :func:`error` and its warnings through
:func:`warn`, so a message is escaped for rich exactly once, whoever raised it.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape


def stderr_console() -> Console:
    """No emoji codes: ``file.py:M: ...`` in a message is a path and a class, not ``:M:`` (Ⓜ)."""
    return Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def error(message: str) -> None:
    """``perfrun: error: MESSAGE`` in red on stderr; the message is printed as is."""
    stderr_console().print(f"[bold red]perfrun: error:[/] {escape(message)}")


def warn(message: str) -> None:
    """``perfrun: warning: MESSAGE`` in yellow on stderr; the message is printed as is."""
    stderr_console().print(f"[bold yellow]perfrun: warning:[/] {escape(message)}")


JSON_KINDS = {"str": "a string", "list": "a list", "dict": "an object", "int": "a whole number", "float": "a number",
              "bool": "true or false", "NoneType": "null"}


def json_kinds(types: tuple[type, ...]) -> str:
    """What a JSON value of one of ``types`` is, in words (``(int, float, NoneType)``: "a number
    or null"), for a line that says a file's field is of another type."""
    return " or ".join(JSON_KINDS[t.__name__] for t in types if not (t is int and float in types))


def first_line(exc: BaseException | str, limit: int = 160) -> str:
    """The first line of an exception's message (its type's name when it has none), cut to
    ``limit`` characters: what fits inside a one-line error."""
    lines = str(exc).strip().splitlines()
    if lines:
        return lines[0][:limit]
    return (type(exc).__name__ if isinstance(exc, BaseException) else "")[:limit]


def fmt(value: Any, spec: str = ".1f", *, scale: float = 1.0, unit: str = "", missing: str = "n/a") -> str:
    """A figure as a table cell: ``value * scale`` in ``spec`` with ``unit``; ``missing``
    where there is no finite number (None, NaN, a value that was N/A when read)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return missing
    return f"{value * scale:{spec}}{unit}"


def composition_error(exc: BaseException, command: str = "train") -> str:
    """Hydra's composition errors as one line: what was wrong and how to fix it."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group = exc.missing_cfg_file.rsplit("/", 1)[0] if exc.missing_cfg_file else "the group"
        wrong = exc.missing_cfg_file.rsplit("/", 1)[-1] if exc.missing_cfg_file else "?"
        return f"{group}={wrong} is not an option of {group}; choose one of {', '.join(exc.options)}"
    text = str(exc).strip()
    cause = exc.__cause__
    if text.startswith("Could not override"):
        key = text.split("'")[1] if "'" in text else text
        return (f"{key} is not a key of the configuration; list the keys with perfrun {command} --cfg job "
                "(a misspelt group or key is the usual cause)")
    if text.startswith("Error merging override") and cause is not None:
        override = text.removeprefix("Error merging override").strip()
        reason = str(cause).strip().splitlines()[0]
        return f"{override}: {reason}; give a value of the type the key takes (perfrun {command} --cfg job shows them)"
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"{first} (perfrun {command} --help lists the groups and options)"


def wide_console(renderables: Sequence[Any]) -> Console:
    """The standard console; off a terminal with no COLUMNS set (a pipe, a log file), as
    wide as the tables need, so that no figure is cut to an ellipsis at rich's default 80."""
    console = Console(highlight=False)
    if console.is_terminal or "COLUMNS" in os.environ or not renderables:
        return console
    wide = console.options.update(width=10_000)
    need = max(console.measure(t, options=wide).maximum for t in renderables)
    return Console(highlight=False, width=max(console.width, need))


def hydra_quoted(text: str) -> str:
    """``text`` as a single-quoted Hydra value that composes back to exactly ``text``:
    backslashes before a quote, before ``${`` or at the end are doubled, quotes and ``${``
    escaped (so nothing is read as an interpolation)."""
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return f"'{text}'"


@contextmanager
def kept_logging() -> Iterator[None]:
    """The root logger as it was: a Hydra app configures it for its job (a console handler,
    a log file in the job's dir), which a caller in the same process should not inherit."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:], root.level = handlers, level
