"""Run, sweep and tune summaries: one table, a plot, CSV/JSON/HTML/Markdown.

One source of truth: every row is read back from a job's ``summary.json`` (and, for loss
parity, its ``metrics.jsonl``). The sweep callback (:mod:`perfrun.ladder.callback`) and ``perfrun
report`` both call :func:`load` and the same renderers, so the report of a sweep dir
reproduces the table, CSV and JSON the sweep wrote, byte for byte.

- :mod:`~perfrun.report.reading`: directories -> rows (:mod:`~perfrun.report.rows`)
- :mod:`~perfrun.report.noise`: repeats as median and spread; effects outside the noise only
- :mod:`~perfrun.report.columns`: each column defined once, for every format
- :mod:`~perfrun.report.render`: rich, CSV, JSON, HTML and Markdown
- :mod:`~perfrun.report.plot`: tokens/s against each swept key (matplotlib)
- :mod:`~perfrun.ladder.translations`: each key in Hugging Face's, Lightning's and PyTorch's words, as data;
  :mod:`~perfrun.ladder.answer` picks the configuration (a run, a verdict, a rung), :mod:`~perfrun.ladder.recorded`
  checks it, :mod:`~perfrun.ladder.translate` prints it (``perfrun report PATH --as``)
- :mod:`~perfrun.commands.report`: ``perfrun report`` (argparse: it takes paths and flags)

A ladder's maths, verdict and plots, and the files a sweep leaves, are :mod:`perfrun.ladder`'s:
they build on this package, which knows no ladder beyond the rows it renders.
"""

from perfrun.report.plot import PLOT_HINT, plot_or_warn, plot_png
from perfrun.report.reading import (
    Group,
    effective_value,
    group_repeats,
    job_dirs,
    load,
    read_row,
    swept_keys,
)
from perfrun.report.render import (
    print_report,
    render_text,
    to_csv,
    to_dict,
    to_html,
    to_json,
    to_markdown,
)
from perfrun.report.rows import Report, ReportError, Row, override_key

__all__ = [
    "PLOT_HINT", "Group", "Report", "ReportError", "Row", "effective_value", "group_repeats", "job_dirs", "load",
    "override_key", "plot_or_warn", "plot_png", "print_report", "read_row", "render_text", "swept_keys",
    "to_csv", "to_dict", "to_html", "to_json", "to_markdown",
]
