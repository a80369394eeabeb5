"""Every job assesses contention, the monitor's thread on or off: with
``monitor.every_n_steps=0`` the host's CPU and the interval step times are read at the log
points (telemetry.contention.LoadMeter), and a neighbour burning every core marks the job
contended instead of leaving it "unknown" (which used to count as quiet). Real tiny jobs."""

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


def test_load_meter_leaves_the_warm_up_out_of_the_step_times() -> None:
    meter = LoadMeter()
    meter.start()
    for first, t in ((0, 0.9), (3, 0.1), (6, 0.11), (9, 0.1)):
        sum(range(20_000))  # some CPU of this process in each interval
        meter.interval(first, first + 3, t)
    figures = meter.figures(warmup=3)
    assert figures["interval_step_times_s"] == [0.1, 0.11, 0.1]
    assert figures["proc_cpu_pct_mean"] is not None and figures["proc_cpu_pct_mean"] >= 0
    assert LoadMeter().figures(warmup=0) == {}  # no interval ended: nothing to judge by
