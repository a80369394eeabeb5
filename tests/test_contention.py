"""Every job assesses contention, the monitor's thread on or off, however short: the host's
CPU is read at the end of the warm-up and the end of the loop (telemetry.contention.LoadMeter),
so a neighbour burning every core marks the job contended, a budgeted job that ends before
the monitor's first interval included, instead of leaving it "unknown". A job whose
contention is unknown all the same is flagged and counted nowhere. Real tiny jobs, and a
planted ladder for the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_ladder import plant_ladder

from perfrun.telemetry import contention
from perfrun.telemetry.contention import LoadMeter, usable_cpus

from conftest import make_cfg, wait_for

OFF = ["max_steps=30", "log_every=3", "timing_warmup_steps=3", "monitor.every_n_steps=0"]


def test_a_job_with_the_monitor_off_is_still_assessed(tmp_path: Path, one_thread: None) -> None:
    from perfrun.loop.run import run

    s = run(make_cfg(*OFF), tmp_path, overrides=OFF)
    load = s["host_load"]
    assert "monitor" not in s and load["method"].startswith("CPU time against the wall clock")
    assert load["proc_cpu_pct_mean"] > 0 and 0 <= load["host_cpu_pct_mean"] <= 100
    # intervals of 3 steps; those starting at or after the 3 warm-up steps: 3, 6, ..., 27
    assert len(load["interval_step_times_s"]) == 9 and all(t > 0 for t in load["interval_step_times_s"])
    verdict = s["contention"]
    assert verdict["contended"] in (True, False)  # assessed: never None (unknown) for want of a monitor
    assert verdict["proc_cpu_pct"] == load["proc_cpu_pct_mean"] and verdict["step_time_spread"] is not None
    assert json.loads((tmp_path / "summary.json").read_text())["contention"]["contended"] == verdict["contended"]


@pytest.fixture
def neighbour() -> Iterator[None]:
    """A process per usable core spinning beside the job, as grandchildren (``sh`` starts
    them) so that the job does not take them for its DataLoader workers."""
    spin = f"{sys.executable} -c 'while True: pass' &"
    sh = subprocess.Popen(["sh", "-c", " ".join([spin] * usable_cpus()) + " wait"], start_new_session=True)
    try:
        shell = psutil.Process(sh.pid)
        wait_for(lambda: len(shell.children()) == usable_cpus() and
                 all(c.cpu_times().user > 0.05 for c in shell.children()), timeout=30)
        yield
    finally:
        os.killpg(sh.pid, signal.SIGKILL)
        sh.wait()


def test_a_neighbour_on_every_core_marks_a_job_without_monitor_contended(
        tmp_path: Path, one_thread: None, neighbour: None) -> None:
    from perfrun.loop.run import run

    s = run(make_cfg(*OFF), tmp_path, overrides=OFF)
    verdict = s["contention"]
    assert verdict["contended"] is True, verdict
    assert verdict["idle_cpu_pct"] < 50 and any("other processes used" in e for e in verdict["evidence"]), verdict


def test_load_meter_covers_the_steady_steps_and_leaves_the_warm_up_out_of_the_step_times() -> None:
    meter = LoadMeter()
    meter.start()
    assert meter.figures(warmup=3, steady_steps=0) == {}  # the loop has not ended: nothing to judge by
    for first, t in ((0, 0.9), (3, 0.1), (6, 0.11), (9, 0.1)):
        if first == 3:
            meter.steady()
        sum(range(20_000))  # some CPU of this process in each interval
        meter.interval(first, first + 3, t)
    meter.finish()
    figures = meter.figures(warmup=3, steady_steps=9)
    assert figures["interval_step_times_s"] == [0.1, 0.11, 0.1] and figures["window"] == "steady steps"
    assert figures["proc_cpu_pct_mean"] is not None and figures["proc_cpu_pct_mean"] >= 0
    assert meter.figures(warmup=3, steady_steps=0)["window"] == "every step (none after the warm-up)"


# A budgeted ladder job, as the ladder runs it (the monitor on, every 10 steps by default), that
# stops after its warm-up and 10 steady steps: before the monitor's first interval closes.
BUDGETED = ["max_steps=1000", "log_every=100", "timing_warmup_steps=2", "monitor.every_n_steps=100",
            "ablation.budget_s=0.01"]


def test_a_budgeted_job_that_ends_before_the_monitors_first_interval_is_contended_beside_a_busy_neighbour(
        tmp_path: Path, one_thread: None, neighbour: None) -> None:
    from perfrun import report
    from perfrun.loop.run import run

    s = run(make_cfg(*BUDGETED), tmp_path, overrides=BUDGETED)
    assert s["budget"]["stopped_at_budget"] and s["steps"] < 100  # no monitor interval, no log point closed
    assert s["monitor"]["host_cpu_pct_mean"] is None  # the monitor has no figure of its own
    verdict = s["contention"]
    assert verdict["contended"] is True, verdict
    assert any("other processes used" in e for e in verdict["evidence"]), verdict
    assert s["host_load"]["window"] == "steady steps" and s["host_load"]["window_s"] > 0
    (row,) = report.load([tmp_path]).rows
    assert row.contended is True and not row.quiet


def test_a_job_shorter_than_the_sampling_period_is_assessed(tmp_path: Path, one_thread: None) -> None:
    from perfrun.loop.run import run

    args = ["max_steps=6", "timing_warmup_steps=2", "monitor.every_n_steps=100", "monitor.sample_interval_s=60"]
    s = run(make_cfg(*args), tmp_path, overrides=args)
    assert s["contention"]["contended"] in (True, False), s["contention"]  # never None: the loop's ends were read
    assert s["contention"]["proc_cpu_pct"] == s["host_load"]["proc_cpu_pct_mean"] is not None


def unknown(job: Path) -> None:
    """The job's summary.json as run() writes it where the host's CPU could not be read."""
    s = json.loads((job / "summary.json").read_text())
    s["contention"] = contention.assess({})
    (job / "summary.json").write_text(json.dumps(s))


def test_a_job_of_unknown_contention_is_flagged_and_feeds_neither_the_noise_nor_the_verdict(tmp_path: Path) -> None:
    """The ladder of test_ladder (naive ~1000 tokens/s, compile 2x sdpa) with compile's three
    jobs and one naive job of unknown contention, that naive job 3x faster than its repeats:
    counted, it would widen the machine's noise to ±100 % and rank compile."""
    from perfrun.ladder.analysis import read_sweep
    from perfrun.report import render

    plant_ladder(tmp_path)
    rungs = {json.loads((job / "summary.json").read_text())["config"]["ablation"]["rung"]: job
             for job in sorted(tmp_path.iterdir(), key=lambda p: -int(p.name))}  # each rung's first job
    compile_jobs = [job for job in tmp_path.iterdir()
                    if json.loads((job / "summary.json").read_text())["config"]["ablation"]["rung"] == "compile"]
    for job in compile_jobs:
        unknown(job)
    naive = rungs["naive"]
    s = json.loads((naive / "summary.json").read_text())
    s["tokens_per_s_median"] = 3000.0
    (naive / "summary.json").write_text(json.dumps(s))
    unknown(naive)

    r = read_sweep([tmp_path])
    (a,) = r.ladders
    assert a["machine_noise_pct"] == pytest.approx(3.0)  # 980..1040 of the five measured naive jobs
    entry = {e["rung"]: e for e in a["ladder"]}
    assert entry["compile"]["n"] == 0 and entry["compile"]["unknown"] == 3
    assert entry["compile"]["verdict"] == "not ranked: whether 3 job(s) had the machine is unknown"
    assert entry["naive"]["n"] == 2 and entry["naive"]["unknown"] == 1
    assert a["recommended"]["measured_as"] != "compile" and "measured as compile" not in a["verdict"]
    assert sorted(a["unknown_contention_jobs"], key=int) == sorted([j.name for j in [*compile_jobs, naive]], key=int)
    assert any("have no contention figures" in n for n in a["notes"])
    flagged = {row.job for row in r.rows if row.machine_unknown}
    assert flagged == set(a["unknown_contention_jobs"])
    table = render.to_markdown(r)
    assert "| unknown |" in table and "2 (+1 unknown)" in table  # the runs table's column, the naive rung's runs


def test_the_monitors_host_means_stand_only_over_its_steady_intervals() -> None:
    """A job that closed monitor intervals in its warm-up alone is judged by the steady steps'
    counters, not by a warm-up whose compilation workers read as another process."""
    load = {"host_cpu_pct_mean": 55.0, "proc_cpu_pct_mean": 100.0, "interval_step_times_s": []}
    warm_up = {"host_cpu_pct_mean": 100.0, "proc_cpu_pct_mean": 60.0, "host_cpu_window": "all intervals",
               "gpu_other_processes_max": None, "interval_step_times_s": []}
    assert contention.job_figures(warm_up, load)["proc_cpu_pct_mean"] == 100.0
    assert contention.assess(contention.job_figures(warm_up, load), cpus=2)["contended"] is False
    steady = {**warm_up, "host_cpu_window": "steady intervals", "interval_step_times_s": [0.1] * 6}
    figures = contention.job_figures(steady, load)
    assert figures["proc_cpu_pct_mean"] == 60.0 and figures["interval_step_times_s"] == [0.1] * 6
    assert contention.assess(figures, cpus=2)["contended"] is True
    assert contention.assess(contention.job_figures(None, None), cpus=2)["contended"] is None


def test_a_job_of_unknown_contention_says_so_at_its_end(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="perfrun"):
        contention.say(contention.assess({}))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("whether this job had the machine to itself is unknown") and "never counted" in line
