"""Experiment loggers: TensorBoard, Weights & Biases and MLflow receive the records that
metrics.jsonl receives (every train, eval, monitor and checkpoint figure), the
configuration as hyperparameters at the start and the summary at the end.

The loop writes each record once, to :class:`Sinks`, which hands it to metrics.jsonl and
to the logger chosen with ``logger=...``; so adding a logger changes nothing in the loop.
Only rank 0 logs. The jobs of a sweep are one run each under one group (W&B's group,
MLflow's experiment, TensorBoard's parent folder) named after the sweep dir. Each
logger's package is an optional extra, imported only when chosen.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import netrc
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from perfrun.config import ConfigError, TrainConfig, as_dict
from perfrun.console import first_line, warn
from perfrun.telemetry.sinks import JsonlSink, shown_path

log = logging.getLogger("perfrun")

# logger name -> (the module it needs, the pip extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
LOGGERS = ("none", *PACKAGES)
WANDB_MODES = ("auto", "online", "offline")
# summary.json parts that are not figures of the run (the config is logged as hyperparameters)
_NOT_LOGGED = ("config", "overrides", "environment", "global_state_at_start", "global_state_after", "data_position")


def check(logger: Any) -> None:
    """Refuse, before any work, a logger that is not one or whose package is missing."""
    if logger.name not in LOGGERS:
        raise ConfigError(f"logger.name={logger.name} is not an option; choose one of {', '.join(LOGGERS)}")
    if logger.name == "wandb" and logger.mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode={logger.mode} is not an option; choose one of {', '.join(WANDB_MODES)}")
    missing = missing_package(logger.name)
    if missing:
        raise ConfigError(missing)


def missing_package(name: str) -> str | None:
    """One line when ``logger=NAME`` needs a package that this Python lacks."""
    if name not in PACKAGES:
        return None
    module, extra = PACKAGES[name]
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"logger={name} needs the {module} package, which this Python lacks; "
            f"install it with pip install 'perfrun[{extra}]' (or choose logger=none)")


def flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested dicts as ``a.b.c`` keys; lists and other leaves as they are."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def figures(pairs: Iterable[tuple[str, Any]], prefix: str) -> dict[str, float]:
    """The numbers among ``pairs`` (not flags, not NaN), under ``prefix/``."""
    return {f"{prefix}/{k}": float(v) for k, v in pairs
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def record_figures(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as logger scalars: ``train/loss``, ``monitor/power_w_mean``,
    and each rank's own under ``monitor/rank1/...`` when several ranks report."""
    kind = record.get("kind", "record")
    plain = ((k, v) for k, v in record.items() if k not in ("step", "max_steps", "ranks"))
    out = figures(plain, kind)
    for row in record.get("ranks") or []:
        out.update(figures(((k, v) for k, v in row.items() if k != "rank"), f"{kind}/rank{row.get('rank')}"))
    return out


def hyperparameters(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as flat ``model.n_layer``-style keys with plain values."""
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in flatten(config)}


def summary_parts(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The summary's figures (``summary/...``) and its words (status, reason...)."""
    kept = {k: v for k, v in summary.items() if k not in _NOT_LOGGED}
    words = {k: str(v) for k, v in flatten(kept) if isinstance(v, str)}
    return figures(flatten(kept), "summary"), words


class Logger(Protocol):
    def describe(self) -> str: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, step: int, summary: dict[str, Any] | None) -> None: ...


class TensorBoardLogger:
    """Scalars through ``torch.utils.tensorboard``; the configuration in the HParams tab."""

    def __init__(self, folder: Path, config: dict[str, Any], names: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(folder))
        params = hyperparameters(config)
        # the metric named here is written by finish(); HParams shows it beside each run
        self._end = hparams(params, {"summary/tokens_per_s_median": 0.0})
        for summary in self._end[:2]:  # the experiment and this run's values, now
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("run", f"{names['run_name']} (group: {names['group'] or 'none'})")
        self.folder, self.root = folder, names["root"] or folder

    def describe(self) -> str:  # the sweep dir shows every job of a sweep side by side
        return f"TensorBoard logs in {shown_path(self.folder)} (tensorboard --logdir {shown_path(self.root)})"

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, step: int, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            numbers, words = summary_parts(summary)
            self.log(step, numbers)
            for key, text in words.items():
                self.writer.add_text(f"summary/{key}", text, step)
        self.writer.file_writer.add_summary(self._end[2])  # the session's end
        self.writer.close()


class WandbLogger:
    """A W&B run: offline (a folder to ``wandb sync`` later) unless this machine is logged in."""

    def __init__(self, folder: Path, config: dict[str, Any], names: dict[str, Any], mode: str) -> None:
        import wandb

        self.wandb = wandb
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False)
        self.run = wandb.init(project=names["project"], group=names["group"], name=names["run_name"], dir=str(folder),
                              mode=wandb_mode(mode), config=hyperparameters(config), settings=settings)

    def describe(self) -> str:
        if self.run.settings.mode == "offline":
            where = shown_path(self.run.settings.sync_dir)
            return f"W&B offline run in {where}; upload it with wandb sync {where}"
        return f"W&B run {self.run.url}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, step: int, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            numbers, words = summary_parts(summary)
            self.run.summary.update({**numbers, **{f"summary/{k}": v for k, v in words.items()}})
        completed = summary is not None and summary.get("status") == "completed"
        self.run.finish(exit_code=0 if completed else 1)
        # finish() can return before W&B's service has written the run's folder; teardown
        # waits for it, so the run is whole when the job ends (the next job starts a new service)
        self.wandb.teardown()


def wandb_mode(mode: str) -> str | None:
    """``auto``: W&B's own WANDB_MODE when set, online when an API key is at hand (the
    WANDB_API_KEY variable, or the ~/.netrc (or $NETRC) entry that ``wandb login`` writes),
    else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return None  # wandb reads it
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return "online" if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one wandb could not read either
        return "offline"


class MlflowLogger:
    """An MLflow run through ``MlflowClient``: a local file store by default (no server)."""

    def __init__(self, uri: str, config: dict[str, Any], names: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        from perfrun.environment import environment_default

        # MLflow keeps its file store in maintenance mode behind this switch; a local folder of
        # plain files is what a run dir wants (no database, no server). The store is made here.
        switch = environment_default("MLFLOW_ALLOW_FILE_STORE", "true") if uri.startswith("file:") else nullcontext()
        with switch:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = names["group"] or names["project"]
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._create(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=names["run_name"],
                                                 tags={"perfrun.run_dir": names["run_dir"]}).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in hyperparameters(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.uri = uri

    def describe(self) -> str:
        store = shown_path(url2pathname(urlparse(self.uri).path)) if self.uri.startswith("file:") else self.uri
        return f"MLflow run {self.run_id} in {store} (MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {store})"

    def _create(self, name: str) -> str:
        try:
            return self.client.create_experiment(name)
        except Exception:  # noqa: BLE001 - another job of the sweep created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, step: int, summary: dict[str, Any] | None) -> None:
        status = (summary or {}).get("status")
        if summary is not None:
            numbers, words = summary_parts(summary)
            self.log(step, numbers)
            for key, text in words.items():
                self.client.set_tag(self.run_id, f"perfrun.{key}", text[:5000])
        ended = {"completed": "FINISHED", "interrupted": "KILLED"}.get(str(status), "FAILED")
        self.client.set_terminated(self.run_id, ended)


def job_names(cfg: TrainConfig, run_dir: Path | None, sweep_args: Sequence[str] = ()) -> dict[str, Any]:
    """The names a job logs under: its project, its group (a sweep's jobs share the sweep
    dir's), its run name (a sweep job's number and the values swept, else the run dir's
    date and time) and the folder a shared store goes in (the sweep dir, else the run dir).
    ``sweep_args``: the sweep's command line, which tells the values swept from those fixed."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    group, name, root = None, None, run_dir
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            group, root = str(hc.sweep.dir), Path(hc.sweep.dir).absolute()
            name = " ".join([str(hc.job.num), *swept_values(list(hc.overrides.task), sweep_args)])
    if run_dir is not None and name is None:
        name = f"{run_dir.parent.name}/{run_dir.name}"
    lg = cfg.logger
    return {"project": lg.project, "group": lg.group or group, "run_name": lg.run_name or name or "perfrun",
            "run_dir": str(run_dir), "root": root}


def swept_values(job_overrides: list[str], sweep_args: Sequence[str]) -> list[str]:
    """The job's overrides that its sweep varies: those the sweep's command line does not
    fix to one value (``seed=1,2`` there, ``seed=1`` here; ``+ablation=bf16`` from the ladder)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed = {o.key_or_group for o in parser.parse_overrides([a for a in sweep_args if not a.startswith("-")])
             if not o.is_sweep_override()}
    return [text for text, o in zip(job_overrides, parser.parse_overrides(job_overrides), strict=True)
            if o.key_or_group not in fixed]


def sweep_job_names(cfg: TrainConfig, run_dir: Path, sweep_args: Sequence[str]) -> dict[str, str]:
    """A sweep job's names as overrides for its ranks, which see a single run."""
    if cfg.logger.name == "none":
        return {}
    names = job_names(cfg, run_dir, sweep_args)
    out = {"logger.group": names["group"], "logger.run_name": names["run_name"]}
    if cfg.logger.name == "mlflow" and not cfg.logger.dir and names["root"] is not None:
        out["logger.dir"] = str(Path(names["root"]) / "mlruns")
    return {k: v for k, v in out.items() if v}


def start_logger(cfg: TrainConfig, run_dir: Path | None, sweep_args: Sequence[str] = ()) -> Logger | None:
    """The logger ``cfg.logger`` names, started; None for ``logger=none`` or no run dir."""
    lg = cfg.logger
    if lg.name == "none" or (run_dir is None and not lg.dir):
        return None
    names = job_names(cfg, run_dir, sweep_args)
    config = as_dict(cfg)
    if lg.name == "tensorboard":
        return TensorBoardLogger(Path(lg.dir) if lg.dir else Path(run_dir) / "tensorboard", config, names)
    if lg.name == "wandb":
        return WandbLogger(Path(lg.dir) if lg.dir else Path(run_dir), config, names, lg.mode)
    folder = lg.dir or str(Path(names["root"] or run_dir) / "mlruns")
    uri = folder if "://" in folder or folder.startswith("file:") else Path(folder).absolute().as_uri()
    return MlflowLogger(uri, config, names)


class Sinks:
    """Where each record goes: metrics.jsonl, then the experiment logger if one is chosen.
    A logger that fails mid-run is dropped with a warning; metrics.jsonl keeps every record."""

    def __init__(self, jsonl: JsonlSink, logger: Logger | None = None, name: str = "none") -> None:
        self.jsonl, self.logger, self.name = jsonl, logger, name
        self.step = 0

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        self.step = max(self.step, int(record.get("step") or 0))
        if self.logger is not None:
            self._guard("log", lambda: self.logger.log(self.step, record_figures(record)))

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close metrics.jsonl; hand the logger the summary and end its run."""
        self.jsonl.close()
        if self.logger is not None:
            self._guard("finish", lambda: self.logger.finish(self.step, summary))
            self.logger = None

    def _guard(self, what: str, call: Any) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a logger's failure never stops training
            warn(f"logger={self.name} failed to {what} ({type(e).__name__}: {first_line(e)}); "
                 "it logs nothing more in this run, metrics.jsonl has every record")
            self.logger = None


def build_sinks(cfg: TrainConfig, run_dir: Path | None, rank: int, sweep_args: Sequence[str] = ()) -> Sinks:
    """metrics.jsonl and the chosen logger for rank 0; nothing for the other ranks."""
    if rank != 0:
        return Sinks(JsonlSink(None))
    check(cfg.logger)
    try:
        logger = start_logger(cfg, run_dir, sweep_args)
    except Exception as e:  # noqa: BLE001 - a logger that cannot start is the user's to fix, before any work
        fix = "logger.mode=offline logs without a network" if cfg.logger.name == "wandb" else "check logger.dir"
        raise ConfigError(f"logger={cfg.logger.name} could not start ({type(e).__name__}: {first_line(e)}); "
                          f"{fix}, or choose logger=none") from None
    if logger is not None:
        log.info(logger.describe())
    return Sinks(JsonlSink(run_dir / "metrics.jsonl" if run_dir is not None else None), logger, cfg.logger.name)
