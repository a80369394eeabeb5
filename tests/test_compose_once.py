"""A plain ``perfrun train`` composes its configuration once: the composition that checks the
command line is the one the job runs, through Hydra's own job machinery, and the run dir holds
what Hydra's own runner writes (.hydra/config.yaml, hydra.yaml, overrides.yaml, train.log).
Every composition, Hydra's own included, goes through ConfigLoaderImpl.load_configuration,
which is counted here during a real run entered as the command line enters it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from perfrun.commands.dispatch import HYDRA_COMMANDS
from perfrun.commands.dispatch import main as cli_main
from perfrun.commands.hydra_app import run_hydra
from perfrun.commands.tune import kept_logging
from perfrun.config import register_configs
from perfrun.summary import read_summary

from conftest import TINY_MODEL

QUICK = [*TINY_MODEL, "dataloader.batch_size=2", "eval_every=0", "eval_batches=1", "monitor.every_n_steps=0",
         "device=cpu", "progress=off", "log_every=1", "data=synthetic"]


@pytest.fixture
def compositions(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The overrides of each composition made from here on, in this process."""
    made: list[list[str]] = []
    load: Callable[..., Any] = ConfigLoaderImpl.load_configuration

    def counted(self: ConfigLoaderImpl, config_name: str | None, overrides: list[str], *args: Any, **kw: Any) -> Any:
        made.append(list(overrides))
        return load(self, config_name, overrides, *args, **kw)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return made


def train(*args: str) -> int:
    """``perfrun train ARGS`` in this process, as the console script enters: its exit code."""
    with kept_logging():  # the job sets up the root logger for its run
        try:
            return cli_main(["train", *args])
        except SystemExit as e:
            return int(e.code or 0)


def hydra_yaml(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]


def test_a_plain_run_composes_once_and_writes_what_hydra_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compositions: list[list[str]]) -> None:
    monkeypatch.chdir(tmp_path)
    args = [*QUICK, "max_steps=2", "hydra.run.dir=run"]
    assert train(*args) == 0
    assert compositions == [args]
    run = tmp_path / "run"
    s = read_summary(run)
    assert s["status"] == "completed" and s["steps"] == 2
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    log = (run / "train.log").read_text()
    assert "[perfrun][INFO] - run dir run\n" in log and "done:" in log
    # what Hydra's own runner writes for the same command line, before it calls the task
    register_configs()
    with kept_logging():
        run_hydra("train", [*QUICK, "max_steps=2", "hydra.run.dir=reference"], lambda cfg: None)
    reference = tmp_path / "reference"
    for name in ("config.yaml", "overrides.yaml"):
        assert (run / ".hydra" / name).read_text() == (reference / ".hydra" / name).read_text()
    ours, theirs = hydra_yaml(run), hydra_yaml(reference)
    assert ours["overrides"]["hydra"] == ["hydra.run.dir=run", "hydra.mode=RUN"] and ours["mode"] == "RUN"
    assert ours["runtime"]["output_dir"] == str(run) and ours["job"]["name"] == "train"
    for h in (ours, theirs):  # all else the same, the run dir's name aside
        h["run"]["dir"] = h["runtime"]["output_dir"] = h["overrides"]["hydra"][0] = None
    assert ours == theirs


def test_resume_auto_continues_another_run_dir_from_the_one_composition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        compositions: list[list[str]]) -> None:
    monkeypatch.chdir(tmp_path)
    assert train(*QUICK, "max_steps=2", "hydra.run.dir=outputs/first") == 0
    capfd.readouterr()
    compositions.clear()
    assert train(*QUICK, "max_steps=3", "resume=auto") == 0  # a new timestamped run dir under outputs/
    assert "resume=auto: continuing the run in outputs/first from step 2" in capfd.readouterr().err
    assert compositions == [[*QUICK, "max_steps=3", "resume=auto"]]
    first = tmp_path / "outputs" / "first"
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["first"]  # no new run dir
    s = json.loads((first / "summary.json").read_text())
    assert s["status"] == "completed" and s["resumed_from_step"] == 2 and s["steps"] == 3
    h = hydra_yaml(first)  # the run dir as Hydra records a hydra.run.dir given on the command line
    assert h["run"]["dir"] == "outputs/first" and h["runtime"]["output_dir"] == str(first)
    assert h["overrides"]["hydra"] == ["hydra.run.dir='outputs/first'", "hydra.mode=RUN"]
    assert h["overrides"]["task"] == [*QUICK, "max_steps=3", "resume=auto"]


def test_what_hydra_answers_without_a_job_composes_once(compositions: list[list[str]],
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    assert train("--cfg", "job", "max_steps=3") == 0
    assert "max_steps: 3" in capfd.readouterr().out
    assert compositions == [["max_steps=3"]]  # Hydra's own; no search for a run no job continues


def test_a_ranks_overrides_on_its_composition_are_what_hydra_makes_of_them() -> None:
    """A rank under torchrun runs the configuration it composed with its folders and quiet
    logging applied (perfrun.commands.launch.QUIET_RANK): the result, recorded overrides
    included, is the one Hydra composes with them on the command line; what it cannot apply
    is refused, not dropped."""
    from hydra import compose, initialize_config_dir

    from perfrun.commands.hydra_app import with_hydra_overrides
    from perfrun.commands.launch import QUIET_RANK
    from perfrun.config import config_dir

    rank = ["hydra.run.dir='r/0'", "hydra.sweep.dir='s'", *QUIET_RANK]
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        given = compose("train", overrides=[*QUICK, "distributed=ddp"], return_hydra_config=True)
        whole = compose("train", overrides=[*QUICK, "distributed=ddp", *rank], return_hydra_config=True)
    assert "file" in given.hydra.job_logging.handlers  # what QUIET_RANK takes away is there to take
    assert with_hydra_overrides(given, rank) == whole
    for refused in ("~hydra.job_logging.handlers.nope", "~hydra.job_logging.handlers.file=x", "+hydra.x=1", "seed=2"):
        with pytest.raises(ValueError, match=re.escape(refused)):
            with_hydra_overrides(whole, [refused])


WHOLE = [  # group choices and values mixed, a value given twice, a value of a chosen group
    [], ["precision=bf16", "max_steps=3"], ["model=llama-tiny", "model.n_layer=3", "model.n_kv_head=1"],
    ["data=text", "data.path=/x", "loss=chunked", "loss.chunk_size=24"],
    ["checkpointing=full", "accumulation.steps=2", "compile=true", "compile_options.mode=max-autotune", "max_steps=7"],
    ["distributed=fsdp", "fsdp.reshard_after_forward=false", "dataloader.batch_size=auto", "seed=3"],
    ["+ablation=naive", "logger=tensorboard", "optim=adamw", "optim.lr=0.5", "ablation.repeats=2"],
]


@pytest.mark.parametrize("overrides", WHOLE)
def test_the_tests_configuration_is_a_whole_compose(overrides: list[str]) -> None:
    """conftest.make_cfg composes the group choices once and applies the values with Hydra's
    own code: the configuration equals the one Hydra composes from the whole command line."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, typed

    from conftest import TINY, make_cfg

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        whole = typed(compose("train", overrides=TINY + overrides))
        with pytest.raises(Exception) as hydra_says:  # noqa: B017 - the same refusal, whatever its class
            compose("train", overrides=[*TINY, *overrides, "max_steps=abc"])
    assert make_cfg(*overrides) == whole
    with pytest.raises(type(hydra_says.value)):
        make_cfg(*overrides, "max_steps=abc")


def test_a_composition_with_hydras_node_types_as_the_jobs_and_is_left_as_it_was() -> None:
    """What a plain run types (its composition keeps Hydra's node) equals what its job types
    (the same composition without it), a key the schema lacks is refused by both, and the
    composition is left as it was."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from perfrun.config import ConfigError, config_dir, typed

    from conftest import TINY

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        for overrides in (WHOLE[-1], ["+model.n_experts=4"]):
            kept = compose("train", overrides=TINY + overrides, return_hydra_config=True)
            job = kept.copy()
            with open_dict(job):
                del job["hydra"]
            as_written = OmegaConf.to_yaml(kept)
            if overrides == WHOLE[-1]:
                assert typed(kept) == typed(job) and typed(kept).ablation.repeats == 2
            else:
                for composed in (kept, job):
                    with pytest.raises(ConfigError, match="model.n_experts: not a key perfrun knows"):
                        typed(composed)
            assert OmegaConf.to_yaml(kept) == as_written


@pytest.mark.parametrize("command", ["estimate", "export", "generate", "prepare"])
def test_a_commands_schema_is_stored_once_per_process(command: str) -> None:
    """A command's second start in one process (a sweep's jobs, a test's calls) keeps the node
    the first stored: a new node is a changed ConfigStore, for Hydra's compositions kept by
    the suite and for anything else keyed on it."""
    from importlib import import_module

    from hydra.core.config_store import ConfigStore

    app = import_module(f"perfrun.commands.{command}").COMMAND
    app.register()
    node = ConfigStore.instance().repo[f"{command}_schema.yaml"]
    app.register()
    assert ConfigStore.instance().repo[f"{command}_schema.yaml"] is node


@pytest.mark.parametrize("command", HYDRA_COMMANDS)
def test_each_command_stores_its_schema_when_it_starts(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The suite stores every schema before its first composition (hydra_cache.store_schemas);
    each command must still store its own: here it starts with its schema gone. The very
    node stored before is put back after, so the compositions kept on it stay kept."""
    from hydra.core.config_store import ConfigStore

    store, name = ConfigStore.instance().repo, f"{command}_schema.yaml"
    before = store.pop(name)
    try:
        code = cli_main([command, "--cfg", "job"])
        assert name in store and store[name] is not before
    finally:
        store[name] = before
    assert code == 0 and capsys.readouterr().out.strip()
