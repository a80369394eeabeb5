"""The Hydra callback that summarises a multirun when it ends (``hydra.callbacks`` in
conf/train.yaml), and the sweep's failed jobs as its folder tells them.

Both only read what the jobs wrote -- each job's summary.json -- through
:mod:`perfrun.report`, so ``perfrun report SWEEP_DIR`` reproduces the callback's table and
files exactly, and a launcher that runs jobs elsewhere (SLURM, a process per job) changes
nothing. The callback never fails the sweep: a problem writing the summary is one warning
line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def failed_jobs(sweep_dir: Path) -> list[str]:
    """The jobs under ``sweep_dir`` that did not complete, as their summary.json (or its
    absence) tells: ``job N (overrides): reason``. Empty when the folder holds no job. A
    ladder rung skipped as not applicable on the device did not fail."""
    from perfrun.report import ReportError, load

    try:
        report = load([sweep_dir])
    except ReportError:
        return []
    return [f"job {r.job} ({' '.join(r.overrides)}): {r.reason or r.status}"
            for r in report.rows if r.status not in ("completed", "skipped")]


def saves_no_checkpoints(config: DictConfig) -> bool:
    """A sweep whose jobs save nothing to resume from (``checkpoint.at_end=false`` and no
    periodic saves), as ``+sweep=ablation`` sets: it measures, it does not train for keeps."""
    checkpoint = config.get("checkpoint")
    return checkpoint is not None and not checkpoint.get("at_end", True) and not checkpoint.get("every_n_steps", 0)


class SweepSummary(Callback):
    """On multirun end: sweep_summary.csv/.json/.png in the sweep dir and the table on the console."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        repeats = OmegaConf.select(config, "ablation.repeats")
        if isinstance(repeats, int) and repeats < 1:  # the ladder would launch no job at all
            from perfrun.console import error

            error(f"ablation.repeats={repeats} must be >= 1 (the runs of each rung); set ablation.repeats=3, "
                  "or 1 for a single pass")
            raise SystemExit(2)
        if saves_no_checkpoints(config):
            from rich.console import Console

            Console(highlight=False, soft_wrap=True).print(
                "sweep: the jobs save no checkpoints (checkpoint.at_end=false: a measurement); "
                "add checkpoint.at_end=true to keep them", markup=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from perfrun.console import warn
        from perfrun.report import ReportError, write_sweep_summary

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            write_sweep_summary(sweep_dir)
        except ReportError as e:
            warn(f"no sweep summary: {e}")
        except Exception as e:  # noqa: BLE001 - the jobs' results are on disk; never lose them to a summary bug
            warn(f"no sweep summary ({type(e).__name__}: {e}); the jobs' results are in {sweep_dir}, "
                 f"try perfrun report {sweep_dir}")
