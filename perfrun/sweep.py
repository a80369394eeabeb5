"""The Hydra callback that summarises a multirun when it ends (``hydra.callbacks`` in
conf/train.yaml).

It only reads what the jobs wrote -- each job's summary.json -- through
:func:`perfrun.report.write_sweep_summary`, so ``perfrun report SWEEP_DIR`` reproduces its
table and files exactly, and a launcher that runs jobs elsewhere changes nothing. It never
fails the sweep: a problem writing the summary is one warning line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# The jobs of the last sweep that did not complete, as their summary.json (or its absence)
# tells: "job N (overrides): reason". A launcher that runs each job in a process of its own
# (hydra/launcher=slurm or slurm_local) leaves no other trace of a failed job in this process.
FAILED: list[str] = []


class SweepSummary(Callback):
    """On multirun end: sweep_summary.csv/.json/.png in the sweep dir and the table on the console."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        FAILED.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from perfrun.console import warn
        from perfrun.report import ReportError, write_sweep_summary

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            report = write_sweep_summary(sweep_dir)
            FAILED[:] = [f"job {r.job} ({' '.join(r.overrides)}): {r.reason or r.status}"
                         for r in report.rows if r.status != "completed"]
        except ReportError as e:
            warn(f"no sweep summary: {e}")
        except Exception as e:  # noqa: BLE001 - the jobs' results are on disk; never lose them to a summary bug
            warn(f"no sweep summary ({type(e).__name__}: {e}); the jobs' results are in {sweep_dir}, "
                 f"try perfrun report {sweep_dir}")
