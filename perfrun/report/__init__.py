"""Run, sweep and tune summaries: one table, a plot, CSV/JSON/HTML/Markdown, and the ladder.

One source of truth: every row is read back from a job's ``summary.json`` (and, for loss
parity, its ``metrics.jsonl``). The sweep callback (:mod:`perfrun.commands.sweep_callback`) and ``perfrun
report`` both call :func:`load` and the same renderers, so the report of a sweep dir
reproduces the table, CSV and JSON the sweep wrote, byte for byte.

- :mod:`~perfrun.report.reading`: directories -> rows (:mod:`~perfrun.report.rows`)
- :mod:`~perfrun.report.noise`: repeats as median and spread; effects outside the noise only
- :mod:`~perfrun.report.ladder`: the ladder, leave-one-out, trade-offs, calibrated loss parity, the verdict
- :mod:`~perfrun.report.columns`: each column defined once, for every format
- :mod:`~perfrun.report.render`: rich, CSV, JSON, HTML and Markdown
- :mod:`~perfrun.report.plot`: tokens/s against each swept key (matplotlib)
- :mod:`~perfrun.report.sweep_summary`: the files a sweep leaves when it ends
- :mod:`~perfrun.report.translations`: each key in Hugging Face's, Lightning's and PyTorch's words, as data;
  :mod:`~perfrun.report.answer` picks the configuration (a run, a verdict, a rung), :mod:`~perfrun.report.recorded`
  checks it, :mod:`~perfrun.report.translate` prints it (``perfrun report PATH --as``)
- :mod:`~perfrun.commands.report`: ``perfrun report`` (argparse: it takes paths and flags)
"""

from perfrun.report.ladder import DEFAULT_LOSS_WINDOW, ladders, loss_parity, train_losses
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
from perfrun.report.sweep_summary import SWEEP_CSV, SWEEP_JSON, SWEEP_PNG, write_sweep_summary

__all__ = [
    "DEFAULT_LOSS_WINDOW", "PLOT_HINT", "SWEEP_CSV", "SWEEP_JSON", "SWEEP_PNG", "Group",
    "Report", "ReportError", "Row", "effective_value", "group_repeats", "job_dirs", "ladders", "load", "loss_parity",
    "override_key", "plot_or_warn", "plot_png", "print_report", "read_row", "render_text", "swept_keys",
    "to_csv", "to_dict", "to_html", "to_json", "to_markdown", "train_losses", "write_sweep_summary",
]
