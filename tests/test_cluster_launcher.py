"""hydra/launcher=slurm and slurm_local (hydra-submitit-launcher): the configs compose into
the sbatch script perfrun means, a sweep really runs through submitit on this machine (a
job per process, a failed one reported at the end), and without the plugin the user gets
one line. No SLURM cluster is reachable from here: nothing is submitted to one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from perfrun.config import config_dir, register_configs

from conftest import REPO, TINY_MODEL, launch, run_cli

try:
    PLUGIN = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
except ImportError:
    PLUGIN = False
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="needs hydra-submitit-launcher (pip install -e '.[dev]')")

# A job of a few steps
QUICK = [*TINY_MODEL, "dataloader.batch_size=4", "max_steps=3", "log_every=1", "eval_every=0",
         "eval_batches=1", "monitor.every_n_steps=0", "device=cpu", "progress=off",
         "timing_warmup_steps=1", "data.vocab_size=256"]


def hydra_cfg(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@needs_plugin
def test_slurm_launcher_composes_into_one_task_per_node_with_its_gpus(tmp_path: Path) -> None:
    cfg = hydra_cfg("hydra/launcher=slurm", "hydra.launcher.gpus_per_node=8", "hydra.launcher.partition=gpu",
                    "distributed=ddp", "nproc=${hydra:launcher.gpus_per_node}", f"hydra.sweep.dir={tmp_path}")
    hl = cfg.hydra.launcher
    assert hl._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node, hl.partition) == (1, 1, 8, "gpu")
    assert hl.timeout_min == 60 and hl.max_num_timeout == 0 and hl.setup is None
    assert hl.submitit_folder == f"{tmp_path}/.submitit/%j"
    # as in a job: nproc follows the job's GPUs (Hydra's --cfg job --resolve resolves ${hydra:...} as a job does)
    shown = run_cli("train", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=8", "distributed=ddp",
                    "nproc=${hydra:launcher.gpus_per_node}", "--cfg", "job", "--resolve", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "nproc: 8" in shown.stdout.splitlines() and "distributed: ddp" in shown.stdout.splitlines()

    # what the plugin turns into the sbatch script's --cpus-per-task, --mem and --job-name
    assert (hl.cpus_per_task, hl.mem_gb, cfg.hydra.job.name) == (8, 64, "train")


@needs_plugin
def test_slurm_local_is_the_submitit_local_executor() -> None:
    hl = hydra_cfg("hydra/launcher=slurm_local").hydra.launcher
    assert hl._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node) == (1, 1, 0)


@pytest.mark.slow
@needs_plugin
def test_sweep_runs_through_submitit_and_reports_a_failed_job(tmp_path: Path, monkeypatch) -> None:
    """Each job is pickled by submitit and run by a process of its own; the one that fails
    fails there, out of the sweep's process, and the sweep still ends with exit 1 and its line."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two job processes on 2 cores
    sweep = tmp_path / "sweep"
    rc = launch("train", "-m", "hydra/launcher=slurm_local", *QUICK, "data=synthetic,text", f"hydra.sweep.dir={sweep}",
                cwd=tmp_path)
    assert rc == 1
    ok, bad = (json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2))
    assert ok["status"] == "completed" and ok["final_val_loss"] > 0 and ok["steps"] == 3, ok
    assert bad["status"] == "failed" and "data=text needs a file or folder" in bad["reason"]
    logs = sorted((sweep / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 2 and all("Starting with JobEnvironment" in p.read_text() for p in logs)
    pids = {p.parent.name for p in logs}  # the local executor's job ids are the job processes' pids
    assert str(os.getpid()) not in pids
    rows = json.loads((sweep / "sweep_summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["completed", "failed"]


@pytest.mark.parametrize("args", [["hydra/launcher=slurm"], ["-m", "hydra/launcher=slurm_local", "seed=1,2"]])
def test_without_the_plugin_one_line(args: list[str], tmp_path: Path) -> None:
    """A regular package named hydra_plugins, first on the path, hides every installed
    Hydra plugin, as on a machine where hydra-submitit-launcher was never installed."""
    hide = tmp_path / "hide" / "hydra_plugins"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("")
    p = run_cli("train", *args, cwd=tmp_path, env={"PYTHONPATH": f"{hide.parent}{os.pathsep}{REPO}"})
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "needs the Hydra plugin hydra-submitit-launcher" in lines[0]
    assert "pip install 'perfrun[slurm]'" in lines[0]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_the_hiding_trick_hides_the_plugin(tmp_path: Path) -> None:
    """The test above would pass for the wrong reason if the plugin were still found."""
    hide = tmp_path / "hydra_plugins"
    hide.mkdir()
    (hide / "__init__.py").write_text("")
    code = "import importlib.util as u; print(u.find_spec('hydra_plugins.hydra_submitit_launcher'))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


@needs_plugin
@pytest.mark.skipif(shutil.which("srun") is not None, reason="this machine has SLURM's srun")
def test_slurm_sweep_without_slurm_one_line(tmp_path: Path) -> None:
    p = run_cli("train", "-m", "hydra/launcher=slurm", "seed=1,2", cwd=tmp_path)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "no srun on this machine's PATH" in lines[0] and "hydra/launcher=slurm_local" in lines[0]
    assert not (tmp_path / "outputs").exists()
