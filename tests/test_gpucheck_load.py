"""gpu-check under load: a peak measured beside other work is a ``busy`` warning naming what
ran, never ok; a --device the machine lacks is an error naming what it has."""

from __future__ import annotations

import io
import subprocess
import sys

import psutil
import pytest
import torch
from rich.console import Console

from perfrun.commands.gpu_check import main
from perfrun.gpucheck import load
from perfrun.gpucheck.checks import busy_measurements, measurement_checks
from perfrun.gpucheck.render import render
from perfrun.gpucheck.verdict import OK, WARN

MEAS = {"device": "cpu", "matmul": {"fp32": {"tflops": 0.001, "method": "torch.mm, median of 5"}}}
BUSY = {"window": "during", "others_cpu_pct": 150.0, "idle_cpu_pct": 0.0, "cores": 2,
        "top": ["python (pid 4242) 98%"], "busy": True}
QUIET = {**BUSY, "others_cpu_pct": 2.0, "idle_cpu_pct": 190.0, "top": [], "busy": False}


def test_a_peak_measured_under_load_is_a_busy_warning_with_what_ran() -> None:
    quiet = busy_measurements(measurement_checks(MEAS), [{**QUIET, "window": "before"}, QUIET])
    assert [c.status for c in quiet] == [OK]
    (busy,) = busy_measurements(measurement_checks(MEAS), [{**QUIET, "window": "before"}, BUSY])
    assert busy.status == WARN and busy.detail.startswith("busy: 1.0 GFLOPS")
    assert "during: other processes used 150% CPU" in busy.detail and "python (pid 4242) 98%" in busy.detail
    assert load.busy(BUSY) and not load.busy(QUIET) and load.busy({**QUIET, "gpu_processes": ["pid 7 (900 MiB)"]})
    out = Console(file=io.StringIO(), width=200)
    render({"load": [BUSY]}, [busy], out)
    text = out.file.getvalue()
    assert "warning: busy" in text and "python (pid 4242)" in text


def test_the_load_watch_sees_a_real_busy_process() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        child = psutil.Process(spinner.pid)
        with load.LoadWatch("during") as watch:
            start = child.cpu_times().user
            while child.cpu_times().user - start < 0.3:  # the window holds 0.3 s of the spinner's CPU
                pass
        result = watch.result
    finally:
        spinner.kill()
        spinner.wait()
    assert result["others_cpu_pct"] > 0 and result["cores"] >= 1
    assert any(f"(pid {spinner.pid})" in t for t in result["top"]), result


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_index_on_a_cpu_only_machine_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "0", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device 0: this machine has no CUDA device" in err[0]


@pytest.mark.gpu
def test_a_device_index_past_the_last_names_the_devices(capsys: pytest.CaptureFixture[str]) -> None:
    n = torch.cuda.device_count()
    assert main(["--device", str(n), "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"--device {n} does not exist" in err and torch.cuda.get_device_name(0) in err
