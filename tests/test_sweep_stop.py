"""A stopped sweep keeps what it measured: SIGTERM in the middle of a real sweep's second job
writes the sweep summary for the first and marks the second ``stopped`` (not failed); the
command that the stop and ``perfrun report`` print runs only what is missing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from perfrun.report import load

from conftest import REPO, TINY, run_cli, wait_for

QUICK = [o for o in TINY if not o.startswith("max_steps")] + ["max_steps=40", "log_every=1"]


def _trained(job: Path) -> bool:
    rows = (job / "metrics.jsonl").read_text().splitlines() if (job / "metrics.jsonl").is_file() else []
    return any(json.loads(r).get("kind") == "train" for r in rows if r.strip())


def test_sigterm_mid_sweep_keeps_the_finished_job_and_resume_runs_only_the_rest(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    log = tmp_path / "sweep.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stop the sweep
        proc = subprocess.Popen([sys.executable, "-m", "perfrun", "train", "-m", "seed=1,2", *QUICK,
                                 f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, stdout=out, stderr=out)
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

    report = run_cli("report", str(sweep), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    command = next(line for line in report.stdout.splitlines() if "resume=auto" in line)
    args = shlex.split(command[command.index("perfrun train"):])
    assert args[:3] == ["perfrun", "train", "-m"] and f"hydra.sweep.dir={sweep}" in args
    assert "resume=auto" in err.replace("\n", " ")  # the stop said how to finish it too

    done = run_cli(*args[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (sweep / "0" / "summary.json").read_text() == first  # measured before: not run again
    assert "already completed" in done.stdout + done.stderr
    rows = {r.job: r for r in load([sweep]).rows}
    assert rows["1"].status == "completed" and rows["0"].status == "completed"
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 40
    rewritten = json.loads((sweep / "sweep_summary.json").read_text())
    assert {r["job"]: r["status"] for r in rewritten["rows"]} == {"0": "completed", "1": "completed"}
