"""Experiment loggers: a real tiny job logs to TensorBoard, W&B (offline) and MLflow (a file
store), and each is read back with that tool's own reader: the figures equal metrics.jsonl
and summary.json, the configuration is there as hyperparameters, a sweep's jobs share one
group, only rank 0 logs, and a missing package is one line before any work."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from perfrun.commands.dispatch import main as cli_main
from perfrun.commands.train import train_main
from perfrun.config import ConfigError
from perfrun.loop.run import run
from perfrun.telemetry.loggers import Sinks, build_sinks, wandb_mode
from perfrun.telemetry.sinks import JsonlSink

from conftest import TINY, make_cfg

LOGGED = [*TINY, "max_steps=10", "monitor.every_n_steps=5", "checkpoint.at_end=false"]


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_kind(run_dir: Path, kind: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in jsonl(run_dir) if r["kind"] == kind and r.get(key) is not None}


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Path:
    run_dir = tmp_path_factory.mktemp("tb")
    run(make_cfg(*LOGGED, "logger=tensorboard"), run_dir)
    return run_dir


def test_tensorboard_events_read_back(tensorboard_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(tensorboard_run / "tensorboard"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    loss = by_kind(tensorboard_run, "train", "loss")
    assert sorted(scalars["train/loss"]) == sorted(loss) == [5, 10]
    assert scalars["train/loss"] == pytest.approx(loss)  # float32 in the event file
    assert scalars["train/tokens_per_s"] == pytest.approx(by_kind(tensorboard_run, "train", "tokens_per_s"))
    assert scalars["eval/val_loss"] == pytest.approx(by_kind(tensorboard_run, "eval", "val_loss"))
    assert scalars["monitor/rss_mib_max"] == pytest.approx(by_kind(tensorboard_run, "monitor", "rss_mib_max"))
    summary = json.loads((tensorboard_run / "summary.json").read_text())
    assert scalars["summary/tokens_per_s_median"] == {10: pytest.approx(summary["tokens_per_s_median"])}
    start = [plugin_data_pb2.HParamsPluginData.FromString(v) for k, v in events.PluginTagToContent("hparams").items()
             if k.endswith("session_start_info")]
    (params,) = [dict(p.session_start_info.hparams) for p in start]
    assert params["model.n_layer"].number_value == 2 and params["precision.name"].string_value == "none"


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline W&B run: its .wandb file is a LevelDB-style log (32 KiB
    blocks of chunks with a 7-byte header: CRC, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            out.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return out


def items(update: Any) -> dict[str, Any]:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update}


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run(make_cfg(*LOGGED, "logger=wandb", "logger.mode=offline"), tmp_path)
    records = wandb_records(tmp_path)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = items(started.config.update)
    assert config["model.n_layer"] == 2 and config["precision.name"] == "none" and started.project == "perfrun"
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert logged == by_kind(tmp_path, "train", "loss")
    assert {h["_step"]: h["eval/val_loss"] for h in history if "eval/val_loss" in h} == by_kind(tmp_path, "eval", "val_loss")
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(items(r.summary.update))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary/tokens_per_s_median"] == pytest.approx(written["tokens_per_s_median"])
    assert summary["summary/status"] == "completed"


@pytest.mark.slow
def test_mlflow_file_store_reads_back(tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run(make_cfg(*LOGGED, "logger=mlflow"), tmp_path)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # MLflow's switch was set for the run's client only
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this reader's own file store
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("perfrun").experiment_id])
    assert found.info.status == "FINISHED" and found.data.tags["perfrun.status"] == "completed"
    assert found.data.params["model.n_layer"] == "2" and found.data.params["data.name"] == "pysource"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert history == by_kind(tmp_path, "train", "loss")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert found.data.metrics["summary/tokens_per_s_median"] == pytest.approx(written["tokens_per_s_median"])


@pytest.mark.slow
def test_a_sweeps_jobs_share_one_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One MLflow experiment named after the sweep dir, one run per job, in the sweep's store;
    W&B runs under the same group."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "max_steps=2", "checkpoint.at_end=false", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    assert train_main([*args, "logger=mlflow"]) == 0
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this reader's own file store
    client = MlflowClient(tracking_uri=(sweep / "mlruns").as_uri())
    found = client.search_runs([client.get_experiment_by_name(str(sweep)).experiment_id])
    assert sorted(r.info.run_name for r in found) == ["0 seed=1", "1 seed=2"]
    assert not list(sweep.glob("*/mlruns"))  # no store per job

    wandb_sweep = tmp_path / "wandb-sweep"
    assert train_main([*args[:-1], f"hydra.sweep.dir={wandb_sweep}", "logger=wandb", "logger.mode=offline"]) == 0
    runs = [next(r.run for r in wandb_records(wandb_sweep / job) if r.WhichOneof("record_type") == "run")
            for job in ("0", "1")]
    assert [r.run_group for r in runs] == [str(wandb_sweep)] * 2 and [r.display_name for r in runs] == ["0 seed=1", "1 seed=2"]


def test_only_rank_0_logs(tmp_path: Path) -> None:
    sinks = build_sinks(make_cfg("logger=tensorboard"), tmp_path, rank=1)
    sinks.write({"kind": "train", "step": 1, "loss": 1.0})
    sinks.close({"status": "completed"})
    assert sinks.logger is None and list(tmp_path.iterdir()) == []


def test_a_missing_package_is_one_line_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # a None entry in sys.modules is Python's own way of saying a module cannot be imported:
    # importlib.util.find_spec("wandb") then answers None, as in a Python without wandb
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.chdir(tmp_path)
    for args in (["train", *TINY, "logger=wandb"], ["train", "-m", *TINY, "logger=none,wandb"]):
        assert cli_main(args) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert err == ["perfrun: error: logger=wandb needs the wandb package, which this Python lacks; install it with "
                       "pip install 'perfrun[wandb]' (or choose logger=none)"]
    assert not (tmp_path / "outputs").exists()  # nothing started
    with pytest.raises(ConfigError, match="logger=wandb needs the wandb package"):
        build_sinks(make_cfg("logger=wandb"), tmp_path, rank=0)
    assert list(tmp_path.iterdir()) == []


class Failing:
    """A logger whose service went away mid-run."""

    def describe(self) -> str:
        return "failing"

    def log(self, step: int, values: dict[str, float]) -> None:
        raise ConnectionError("the server closed the connection")

    def finish(self, step: int, summary: dict[str, Any] | None) -> None:
        raise AssertionError("a dropped logger is not finished")


def test_a_failing_logger_is_dropped_with_a_warning(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    sinks = Sinks(JsonlSink(tmp_path / "metrics.jsonl"), Failing(), "wandb")
    for step in (1, 2):
        sinks.write({"kind": "train", "step": step, "loss": 1.0})
    sinks.close({"status": "completed"})
    err = capfd.readouterr().err
    assert err.count("perfrun: warning: logger=wandb failed to log (ConnectionError: the server closed") == 1
    assert [r["step"] for r in jsonl(tmp_path)] == [1, 2]  # metrics.jsonl has every record


def test_wandb_goes_online_only_with_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / ".netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode("auto") == "offline"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    os.chmod(netrc, 0o600)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("offline") == "offline"
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode("auto") == "online"
