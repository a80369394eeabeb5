"""A stopped sweep keeps what it measured: SIGTERM in the middle of a real sweep's second job
writes the sweep summary for the first and marks the second ``stopped`` (not failed); the
command that the stop and ``perfrun report`` print runs only what is missing."""

from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path

import pytest

from perfrun.commands.report import main as report_main
from perfrun.console import kept_logging
from perfrun.report import load

from conftest import TINY, child_env, launch, perfrun_process, wait_for

QUICK = [o for o in TINY if not o.startswith("max_steps")] + ["max_steps=40", "log_every=1"]


def _trained(job: Path) -> bool:
    rows = (job / "metrics.jsonl").read_text().splitlines() if (job / "metrics.jsonl").is_file() else []
    return any(json.loads(r).get("kind") == "train" for r in rows if r.strip())


@pytest.mark.slow
def test_sigterm_mid_sweep_keeps_the_finished_job_and_resume_runs_only_the_rest(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = tmp_path / "sweep"
    log = tmp_path / "sweep.log"
    env = child_env(PYTHONUNBUFFERED="1", COLUMNS="200")
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stop the sweep
        proc = perfrun_process("train", "-m", "seed=1,2", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=env,
                               stdout=out, stderr=out)
        try:
            wait_for(lambda: _trained(sweep / "1") or proc.poll() is not None, timeout=200)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=200)
        finally:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    statuses = {r["job"]: r["status"] for r in summary["rows"]}
    assert statuses == {"0": "completed", "1": "stopped"}
    assert "failed" not in err
    first = (sweep / "0" / "summary.json").read_text()

    monkeypatch.setenv("COLUMNS", "200")  # the command on one line, as a wide terminal shows it
    assert report_main([str(sweep)]) == 0
    command = next(line for line in capfd.readouterr().out.splitlines() if "resume=auto" in line)
    args = shlex.split(command[command.index("perfrun train"):])
    assert args[:3] == ["perfrun", "train", "-m"] and f"hydra.sweep.dir={sweep}" in args
    assert "resume=auto" in err.replace("\n", " ")  # the stop said how to finish it too

    with kept_logging():  # the printed command, in this process (the stop above is the real process)
        assert launch(*args[1:], cwd=tmp_path) == 0
    done = capfd.readouterr()
    assert (sweep / "0" / "summary.json").read_text() == first  # measured before: not run again
    assert "already completed" in done.out + done.err
    rows = {r.job: r for r in load([sweep]).rows}
    assert rows["1"].status == "completed" and rows["0"].status == "completed"
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 40
    rewritten = json.loads((sweep / "sweep_summary.json").read_text())
    assert {r["job"]: r["status"] for r in rewritten["rows"]} == {"0": "completed", "1": "completed"}
