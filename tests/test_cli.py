"""``perfrun`` as a user runs it: real subprocesses, real run directories."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from perfrun.commands.dispatch import main as cli_main
from perfrun.console import kept_logging

from conftest import REPO, TINY_MODEL, launch, run_cli


def summaries(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("summary.json"))]


def test_help_lists_the_commands(tmp_path: Path) -> None:
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    assert "train" in r.stdout and "gpu-check" in r.stdout
    assert "--version" in r.stdout and "--json" in r.stdout
    v = run_cli("--version", cwd=tmp_path)
    assert v.returncode == 0 and v.stdout.startswith("perfrun ")
    bad = run_cli("trian", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown command 'trian'" in bad.stderr and "Traceback" not in bad.stderr


def test_train_is_a_hydra_app(tmp_path: Path) -> None:
    h = run_cli("train", "--help", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})  # -X importtime
    assert h.returncode == 0 and "precision: bf16, fp16, fp8, none" in h.stdout and "perfrun train" in h.stdout
    imported = [line.split("|")[-1].strip() for line in h.stderr.splitlines() if line.startswith("import time:")]
    assert "hydra" in imported and "torch" not in imported  # --help composes; the trainer is a job's import
    groups = h.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "logger: mlflow, none, tensorboard, wandb" in groups and "sweep: ablation" in groups
    assert "ablation:" not in groups  # the presets +sweep=ablation picks are not offered
    assert not (tmp_path / "outputs").exists()  # --help does no work


def test_hydras_own_flags_answer_without_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--cfg and --info, in this process (the process is test_train_is_a_hydra_app's point)."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--cfg", "hydra", "+sweep=ablation"]) == 0
    assert "naive,naive_seed,tf32,bf16" in capsys.readouterr().out  # the presets not offered still work
    assert cli_main(["train", "--cfg", "job", "precision=bf16", "compile=true"]) == 0
    out = capsys.readouterr().out
    assert "dtype: bfloat16" in out and "compile: true" in out
    assert cli_main(["train", "--info"]) == 0
    assert "Config search path" in capsys.readouterr().out
    assert not (tmp_path / "outputs").exists()  # --cfg/--info do no work


@pytest.mark.slow
def test_help_is_the_text_hydra_prints_and_a_bad_override_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """perfrun fills in only the placeholder its help templates use (Hydra lists every config
    group whether a template shows them or not); Hydra's own --help, which perfrun leaves
    to Hydra where --config-dir is given, prints the same text. An override that does not
    compose is one line instead of Hydra's page."""
    assert cli_main(["generate", "--help"]) == 0
    ours = capsys.readouterr().out
    assert cli_main(["generate", "--help", "--config-dir", str(REPO / "conf")]) == 0
    assert capsys.readouterr().out == ours and "== Keys (key=value) ==" in ours and "temperature" in ours
    with pytest.raises(SystemExit) as stop:  # train's Hydra app exits through SystemExit, as under Hydra
        cli_main(["train", "precision=bf17", "--help"])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "perfrun: error: precision=bf17 is not an option of precision; choose one of bf16, fp16, fp8, none"]
    assert cli_main(["generate", "temperature=warm", "--help"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "temperature=warm" in err and "perfrun generate --cfg job" in err


def test_shell_completion_through_the_subcommand(tmp_path: Path) -> None:
    install = run_cli("train", "-sc", "install=bash", cwd=tmp_path)
    assert install.returncode == 0 and "complete" in install.stdout and "hydra_bash_completion" in install.stdout
    env = {"COMP_LINE": "perfrun train precision=b", "COMP_POINT": "25"}
    q = run_cli("-sc", "query=bash", cwd=tmp_path, env={**env, "PYTHONPROFILEIMPORTTIME": "1"})  # -X importtime
    assert q.returncode == 0 and "precision=bf16" in q.stdout.split()
    imported = [line.split("|")[-1].strip() for line in q.stderr.splitlines() if line.startswith("import time:")]
    assert "hydra" in imported and "torch" not in imported  # a Tab composes the config, never imports torch
    keys = run_cli("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "perfrun train logger.mo", "COMP_POINT": "23"})
    assert keys.stdout.split() == ["logger.mode="]
    sub = run_cli("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "perfrun gp", "COMP_POINT": "10"})
    assert sub.stdout.split() == ["gpu-check"]


@pytest.mark.parametrize(("line", "expected"), [("perfrun generate max_n", ["max_new_tokens="]),
                                                 ("perfrun prepare tok", ["tokenizer="]),
                                                 ("perfrun tune tune.st", ["tune.start=", "tune.steps="])])
def test_shell_completion_of_the_other_hydra_commands(line: str, expected: list[str], monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (test_shell_completion_through_the_subcommand runs the real one)."""
    monkeypatch.setenv("COMP_LINE", line)
    monkeypatch.setenv("COMP_POINT", str(len(line)))
    assert cli_main(["-sc", "query=bash"]) == 0
    assert sorted(capsys.readouterr().out.split()) == expected


def test_plain_run_writes_its_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capfd: pytest.CaptureFixture[str], one_thread: None) -> None:
    """In this process, its file descriptors captured (a fresh interpreter adds nothing that
    test_bad_input_in_a_real_process and the sweeps here do not already start)."""
    monkeypatch.chdir(tmp_path)
    code = cli_main(["train", "device=cpu", "max_steps=50", *TINY_MODEL, "log_every=10", "eval_batches=2"])
    out, err = capfd.readouterr()
    assert code == 0, err
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 50
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["kind"] == "train" for line in lines) == 5
    assert "step 50/50" in out and "tok/s" in out  # plain lines when not a terminal


@pytest.mark.slow
def test_train_json_prints_the_summary_on_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # in this process, file descriptors captured
    assert cli_main(["train", "--json", "device=cpu", "max_steps=3", *TINY_MODEL, "eval_batches=2"]) == 0
    out, err = capfd.readouterr()
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    assert json.loads(out) == json.loads((run_dir / "summary.json").read_text())  # stdout is the JSON alone
    assert "step 3/3" in err and f"run dir {run_dir.relative_to(tmp_path)}" in err  # the log, on stderr
    with kept_logging():  # a sweep's Hydra app configures the root logger
        assert cli_main(["train", "--json", "-m", "device=cpu", "max_steps=2", *TINY_MODEL, "eval_batches=1",
                         "seed=1,2", "hydra.sweep.dir=sweep"]) == 0
    jobs = json.loads(capfd.readouterr().out)
    assert [j["config"]["seed"] for j in jobs] == [1, 2] and [j["status"] for j in jobs] == ["completed"] * 2


@pytest.mark.slow
def test_gpt2_with_checkpointing_and_accumulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  one_thread: None) -> None:
    """``perfrun train model=gpt2 checkpointing=full accumulation.steps=4`` as typed, with gpt2
    cut to 3 of its 12 blocks to stay fast (in this process: the command line is the point, not
    a fresh interpreter)."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "model=gpt2", "checkpointing=full", "accumulation.steps=4", "device=cpu",
                     "max_steps=1", "model.n_layer=3", "data.seq_len=32", "dataloader.batch_size=1", "eval_batches=1",
                     "monitor.every_n_steps=0"]) == 0
    (s,) = summaries(tmp_path)
    assert s["knobs"]["checkpointed_blocks"] == 3 and s["knobs"]["accumulation_steps"] == 4
    assert s["config"]["model"]["n_embd"] == 768 and s["config"]["model"]["block_size"] == 1024


@pytest.mark.slow
def test_multirun_sweep_and_clean_state_between_jobs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """One sweep as a user types it (its launcher in this process): its jobs, their clean
    state, and Hydra's lines in our style."""
    with kept_logging():  # a sweep's Hydra app configures the root logger
        code = launch("train", "-m", "dataloader.batch_size=2,4", "dataloader.num_workers=0,2", "cudnn_benchmark=true",
                      *TINY_MODEL, "max_steps=6", "eval_batches=2", "log_every=3", "device=cpu", "progress=off",
                      "monitor.every_n_steps=0", cwd=tmp_path)
    out, err = capfd.readouterr()
    assert code == 0, err
    lines = out.splitlines()  # Hydra's own lines share our timestamp style
    hydra = [line for line in lines if "Launching 4 jobs locally" in line or " : " in line]
    assert len(hydra) == 5 and all(re.match(r"^\d\d:\d\d:\d\d\s", line) for line in hydra), out
    assert not any("[HYDRA]" in line for line in lines)
    jobs = summaries(tmp_path / "outputs")
    assert len(jobs) == 4 and all(j["status"] == "completed" for j in jobs)
    assert sorted((j["config"]["dataloader"]["batch_size"], j["config"]["dataloader"]["num_workers"]) for j in jobs) == [
        (2, 0), (2, 2), (4, 0), (4, 2)]
    first = jobs[0]["global_state_at_start"]
    for j in jobs:  # each job starts as the first did, though every job turned cudnn.benchmark on
        assert j["global_state_at_start"] == first
        assert j["global_state_after"] == first
        assert j["knobs"]["cudnn_benchmark"] is True


@pytest.mark.parametrize(
    "args, rc, words",
    [
        (["precision=bf17"], 2, "precision=bf17 is not an option of precision; choose one of bf16, fp16, fp8, none"),
        (["dataloader.batch_size=0"], 2, "dataloader.batch_size=0 must be >= 1"),
    ],
)
def test_bad_input_in_a_real_process(tmp_path: Path, args: list[str], rc: int, words: str) -> None:
    """The exit code and stderr as a shell sees them (tests/test_reliability.py runs the
    full table of bad inputs in-process)."""
    r = run_cli("train", *args, cwd=tmp_path)
    assert r.returncode == rc
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("perfrun: error:") and words in errors[0]
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.slow
def test_wheel_ships_the_config_and_runs_from_anywhere(tmp_path: Path) -> None:
    """A plain (non-editable) install carries conf/ inside the package."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("perfrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "perfrun/conf/train.yaml" in names and "perfrun/conf/precision/bf16.yaml" in names
    assert "perfrun/conf/hydra/job_logging/rich.yaml" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-m", "perfrun", "train", "--cfg", "job", "model=gpt2"], cwd=elsewhere,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "n_layer: 12" in r.stdout
    where = subprocess.run([sys.executable, "-c", "import perfrun.commands.train as c; print(c.config_dir())"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(site))


def test_the_program_freezes_its_heap_on_the_way_out() -> None:
    """The interpreter's last full collection would walk every object torch made (~1 s on
    2 cores): the program freezes the heap once the command has returned, before atexit."""
    code = ("import atexit, gc, runpy, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count())); "
            "sys.argv = ['perfrun', '--version']; runpy.run_module('perfrun', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    version, frozen = out.stdout.splitlines()
    assert version.startswith("perfrun ") and int(frozen.split()[1]) > 0
