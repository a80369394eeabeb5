"""Nothing lost: a finished result is never destroyed, resume=auto continues the run that
was stopped, one job per run dir, and a true ending (a full disk, an unexpected error, a
sweep's dying job) -- each the way a user meets it, through ``perfrun train``."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from perfrun.checkpoint import files as checkpoint_files
from perfrun.commands.dispatch import main as cli_main
from perfrun.report.metrics_file import train_records

from conftest import REPO, start_train, wait_for

SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "dataloader.batch_size=2",
         "eval_batches=1", "eval_every=0", "monitor.every_n_steps=0", "device=cpu", "progress=off", "log_every=1"]


def train(*args: str) -> int:
    """``perfrun train [flags] SMALL args`` in this process: its exit code."""
    flags = [a for a in args if a.startswith("-")]
    try:
        return cli_main(["train", *flags, *SMALL, *(a for a in args if a not in flags)])
    except SystemExit as e:  # Hydra's app exits through SystemExit
        return int(e.code or 0)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("perfrun: error:") and "Traceback" not in err, err
    return lines[0]


# -- 2. a finished result is never destroyed ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("refused", [
    ["resume=auto"],  # already at max_steps (also what follows a kill -9 after the run finished)
    ["optim.lr=nan"],  # any bad value given with that run dir
    ["resume=auto", "data.seq_len=4096"],
    ["resume=auto", "seed=1"],  # a checkpoint of another data order
])
def test_a_refused_command_leaves_a_completed_run_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture, refused: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert train("max_steps=3", "hydra.run.dir=run") == 0
    assert summary(tmp_path / "run")["status"] == "completed"
    before = digest(tmp_path / "run")
    capfd.readouterr()
    assert train("max_steps=3", "hydra.run.dir=run", *refused) == 2
    one_error_line(capfd.readouterr().err)
    assert digest(tmp_path / "run") == before


@pytest.mark.slow
def test_a_resume_keeps_the_history_and_report_drops_redone_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert train("max_steps=6", "checkpoint.every_n_steps=3", "checkpoint.keep_last=5", "hydra.run.dir=run") == 0
    first = summary(run)
    third = run / "checkpoints" / "step_0000003.pt"
    assert train("max_steps=6", "checkpoint.every_n_steps=3", "checkpoint.keep_last=5", "hydra.run.dir=run",
                 f"resume={third}") == 0
    second = summary(run)
    assert second["status"] == "completed" and second["resumed_from_step"] == 3
    assert second["resumed_from"] == str(third)
    assert [h["status"] for h in second["history"]] == ["completed"]
    assert second["history"][0]["final_train_loss"] == first["final_train_loss"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    assert [r for r in records if r["kind"] == "start"] == [{"kind": "start", "step": 3, "resumed_from": str(third)}]
    curve = {r["step"]: r["loss"] for r in train_records(run)}
    after_resume = [r["loss"] for r in records if r["kind"] == "train"][-3:]
    assert sorted(curve) == [1, 2, 3, 4, 5, 6] and [curve[s] for s in (4, 5, 6)] == after_resume


def test_report_drops_rows_past_the_step_a_resume_continues_from(tmp_path: Path) -> None:
    """A run killed after step 5 with a checkpoint at 3, resumed to max_steps=4: steps 5 and
    6 of the first job were never part of the run that ended."""
    rows = [{"kind": "train", "step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4, 5)]
    rows += [{"kind": "start", "step": 3, "resumed_from": "c"}, {"kind": "train", "step": 4, "loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["loss"]) for r in train_records(tmp_path)] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]


# -- 3. resume=auto continues the run you stopped -----------------------------------------------

@pytest.mark.slow
def test_resume_auto_from_a_new_run_dir_continues_the_run_of_this_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert train("max_steps=3", "hydra.run.dir=outputs/first") == 0
    assert train("max_steps=3", "seed=7", "hydra.run.dir=outputs/other") == 0  # another configuration
    capfd.readouterr()
    assert train("max_steps=5", "resume=auto", "log_every=2") == 0  # log_every is cosmetic: the same job
    assert "continuing the run in outputs/first from step 3" in capfd.readouterr().err
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first", "other"]  # no new run dir
    s = summary(tmp_path / "outputs" / "first")
    assert s["status"] == "completed" and s["resumed_from_step"] == 3 and s["steps"] == 5
    capfd.readouterr()
    assert train("--json", "max_steps=7", "resume=auto") == 0  # the same, its summary on stdout
    out, err = capfd.readouterr()
    assert "continuing the run in outputs/first from step 5" in err
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first", "other"]
    assert json.loads(out) == summary(tmp_path / "outputs" / "first")
    assert json.loads(out)["resumed_from_step"] == 5 and json.loads(out)["steps"] == 7


@pytest.mark.slow
def test_resume_auto_refuses_when_several_runs_could_be_meant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        assert train("max_steps=2", f"hydra.run.dir=outputs/{name}") == 0
    before = digest(tmp_path / "outputs")
    capfd.readouterr()
    assert train("max_steps=4", "resume=auto") == 2
    line = one_error_line(capfd.readouterr().err)
    assert "2 runs under outputs" in line and "outputs/a" in line and "outputs/b" in line
    assert digest(tmp_path / "outputs") == before
    assert train("--json", "max_steps=4", "resume=auto") == 2  # the same refusal, nothing on stdout
    out, err = capfd.readouterr()
    assert out == "" and "2 runs under outputs" in one_error_line(err)
    assert digest(tmp_path / "outputs") == before


def test_resume_auto_with_no_run_of_this_configuration_starts_fresh(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert train("max_steps=2", "seed=3", "hydra.run.dir=outputs/seed3") == 0
    assert train("max_steps=2", "resume=auto", "hydra.run.dir=outputs/fresh") == 0
    assert summary(tmp_path / "outputs" / "fresh")["resumed_from"] is None


@pytest.mark.slow
def test_the_hint_printed_at_a_stop_continues_the_run_when_pasted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = start_train(tmp_path, *SMALL, "max_steps=100000")
    wait_for(lambda: any(f.stat().st_size > 0 for f in tmp_path.rglob("metrics.jsonl")))
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    hint = one_error_line(err).split("continue with: ", 1)[1]
    words = shlex.split(hint)
    assert words[:2] == ["perfrun", "train"] and words[-1] == "resume=auto"
    (run_dir,) = [f.parent for f in tmp_path.rglob("summary.json")]
    assert f"hydra.run.dir={run_dir}" in words, " ".join(words)
    stopped = summary(run_dir)["steps"]
    monkeypatch.chdir(tmp_path)
    assert cli_main([*words[1:], f"max_steps={stopped + 2}"]) == 0  # as pasted, with a nearer end
    assert [f.parent for f in tmp_path.rglob("summary.json")] == [run_dir]
    s = summary(run_dir)
    assert s["resumed_from_step"] == stopped and s["steps"] == stopped + 2
    assert [h["status"] for h in s["history"]] == ["interrupted"]


@pytest.mark.slow
def test_resume_auto_in_a_sweep_continues_each_job_of_the_sweep_before(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = ["-m", "seed=1,2", "hydra.sweep.dir=sweeps/${now:%H%M%S%f}"]
    assert train(*sweep, "max_steps=2") == 0
    assert train(*sweep, "max_steps=4", "resume=auto") == 0
    first, second = sorted((tmp_path / "sweeps").iterdir())
    for job in ("0", "1"):
        s = summary(second / job)
        assert s["status"] == "completed" and s["resumed_from_step"] == 2 and s["steps"] == 4
        assert Path(s["resumed_from"]).absolute().parent.parent == first / job


# resume=auto with two ranks (distributed=ddp nproc=2, the launcher deciding once for both
# ranks): tests/test_distributed.py continues a copy of its 2-rank run in its run dir
# (test_resume_auto_under_ddp_continues_the_run_in_its_run_dir_exactly), so no 2-rank run is
# trained here for it.


# -- 4. one run per run dir ---------------------------------------------------------------------

HOLD = ("import sys, time; from pathlib import Path; from perfrun.checkpoint.run_lock import locked\n"
        "with locked(Path(sys.argv[1]), 'hydra.run.dir'):\n    print('held', flush=True); time.sleep(600)\n")


@pytest.mark.parametrize("folder_key", ["hydra.run.dir", "checkpoint.dir"])
def test_a_second_job_is_refused_and_a_killed_holders_lock_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, folder_key: str) -> None:
    monkeypatch.chdir(tmp_path)
    held = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capfd.readouterr()
        assert train("max_steps=2", f"{folder_key}={held}") == 2
        line = one_error_line(capfd.readouterr().err)
        assert f"{folder_key}={held} is in use by another perfrun job (pid {holder.pid})" in line
        assert not (held / "summary.json").exists() and not (held / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    assert (held / ".perfrun.lock").read_text().strip() == str(holder.pid)  # stale: its holder died
    assert train("max_steps=2", f"{folder_key}={held}") == 0
    assert "took over the lock of pid" in capfd.readouterr().out


# -- 5. always a true ending --------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 2 MiB filesystem, which fills up."""
    d = tmp_path / "small_disk"
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({mounted.stderr.strip()})")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("where", ["checkpoint.dir", "hydra.run.dir"])
def test_a_full_disk_ends_the_run_failed_with_one_line(tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture, where: str) -> None:
    monkeypatch.chdir(tmp_path)
    target = small_disk / "run"
    run_dir = target if where == "hydra.run.dir" else tmp_path / "run"
    ckdir = target / "checkpoints" if where == "hydra.run.dir" else target
    capfd.readouterr()
    code = train("model.n_embd=64", "max_steps=200", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1000",
                 f"{where}={target}", *([] if where == "hydra.run.dir" else ["hydra.run.dir=run"]))
    err = capfd.readouterr().err
    assert code == 1
    line = one_error_line(err)
    assert "could not save the checkpoint" in line or "disk is full" in line, line
    saved = checkpoint_files.list_checkpoints(ckdir)
    assert len(saved) >= 1
    for ckpt in saved:
        checkpoint_files.load(ckpt)  # every earlier checkpoint intact
    assert not [p for p in ckdir.iterdir() if p.name.endswith(".tmp")]  # the cut write's temp file is gone
    s = summary(run_dir)
    assert s["status"] == "failed" and s["reason"] in line


def test_an_export_onto_a_full_disk_is_one_line(tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert train("model.n_embd=256", "model.n_layer=2", "max_steps=1", "hydra.run.dir=run") == 0
    (ckpt,) = checkpoint_files.list_checkpoints(tmp_path / "run" / "checkpoints")
    capfd.readouterr()
    assert cli_main(["export", f"checkpoint={ckpt}", "format=safetensors", f"out={small_disk / 'hf'}"]) != 0
    line = one_error_line(capfd.readouterr().err)
    assert "the disk is full; free space there or choose another out=" in line, line
    assert not any(p.name.endswith(".tmp") for p in small_disk.rglob("*"))


def test_an_unexpected_error_ends_the_run_failed_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture) -> None:
    from perfrun.loop.evaluation import Evaluator

    def broken(self):
        raise ValueError("an evaluation that breaks")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Evaluator, "run", broken)
    capfd.readouterr()
    assert train("max_steps=4", "eval_every=2", "hydra.run.dir=run") == 1
    line = one_error_line(capfd.readouterr().err)
    assert "ValueError: an evaluation that breaks" in line and "train.log" in line
    s = summary(tmp_path / "run")
    assert s["status"] == "failed" and s["reason"] == "ValueError: an evaluation that breaks"
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Traceback" in log and "def broken" not in log and "raise ValueError" in log


@pytest.mark.slow
def test_a_sweep_whose_job_dies_still_writes_its_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capfd: pytest.CaptureFixture) -> None:
    import perfrun.loop.run as train_module

    real = train_module.train_loop

    def dies_for_seed_2(loop, start):
        if loop.checkpointer.seed == 2:
            raise KeyError("a job that dies")
        return real(loop, start)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_module, "train_loop", dies_for_seed_2)
    assert train("-m", "seed=1,2", "max_steps=2", "hydra.sweep.dir=sweep") == 1
    rows = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    text = json.dumps(rows)
    assert "a job that dies" in text
    assert summary(tmp_path / "sweep" / "0")["status"] == "completed"
    assert summary(tmp_path / "sweep" / "1")["status"] == "failed"


def test_temp_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert train("max_steps=2", "hydra.run.dir=run") == 0
    left = [tmp_path / "run" / "checkpoints" / ".step_0000003.pt.a1b2c3d4.tmp", tmp_path / "run" / ".summary.json.zz9_yy8x.tmp"]
    for p in left:
        p.write_bytes(b"half a file")
    keep = tmp_path / "run" / "checkpoints" / "notes.tmp"  # not a name perfrun writes
    keep.write_text("mine")
    assert train("max_steps=3", "hydra.run.dir=run", "resume=auto") == 0
    assert not any(p.exists() for p in left) and keep.exists()
