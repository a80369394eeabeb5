"""The console as a person reads it: one line per log point that fits 80 columns, the GPU's
figures folded into it, one timestamp style for perfrun's and Hydra's lines, on a terminal
and piped, and the run dir said at the start and the end of a run."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import struct
import termios
from fcntl import ioctl
from pathlib import Path

import pytest
from rich.console import Console

from perfrun.console import kept_logging
from perfrun.telemetry import sinks
from perfrun.telemetry.sinks import TIME_WIDTH, ConsoleReporter, gpu_parts, step_line

from conftest import TINY, child_env, launch, perfrun_process

TINY_STEPS = next(int(a.split("=")[1]) for a in TINY if a.startswith("max_steps="))  # logged every 5

TIMED = re.compile(r"^\d\d:\d\d:\d\d \S")  # "06:12:01 message"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def record(step: int = 4000, max_steps: int = 5000, mfu: float | None = 0.452, mem: float | None = 46_182.0) -> dict:
    return {"kind": "train", "step": step, "max_steps": max_steps, "loss": 3.11694, "lr": 6e-4, "grad_norm": 0.913,
            "step_time_ms": 412.3, "tokens_per_s": 1_234_567.0, "mfu": mfu, "host_data_wait_pct": 0.31, "peak_mem_mib": mem}


GPU = {"gpu_util_pct_mean": 98.2, "power_w_mean": 689.6, "temp_c_max": 71.0, "host_cpu_pct_mean": 12.0, "rss_mib_max": 2100.0}


def test_the_step_line_shows_the_windows_steady_steps_and_says_so() -> None:
    steady = {**record(mfu=None), "tokens_per_s": 500.0, "steady_tokens_per_s": 2_000_000.0, "steady_steps_in_interval": 5}
    assert "2.00M tok/s" in step_line(steady, 80 - TIME_WIDTH)  # the warm-up steps' 500 tok/s are left out
    warm = {**steady, "steady_tokens_per_s": None, "steady_steps_in_interval": 0}
    assert "warm-up" in step_line(warm, 80 - TIME_WIDTH) and "tok/s" not in step_line(warm, 80 - TIME_WIDTH)
    assert "median of all the steady steps" in sinks.PROGRESS_LEGEND and "warm-up steps left out" in sinks.PROGRESS_LEGEND


def test_the_step_line_fits_80_columns_with_the_gpu_folded_in() -> None:
    width = 80 - TIME_WIDTH
    line = step_line(record(), width, gpu_parts(GPU))
    assert len(line) <= width
    assert line.startswith("step 4000/5000 loss 3.117 1.23M tok/s MFU 45% mem 45G GPU 98% 690W 71C"), line
    worst = step_line(record(step=123_456, max_steps=200_000), width, gpu_parts(None, [{**GPU, "rank": 0}, {
        **GPU, "gpu_util_pct_mean": 91.0, "power_w_mean": 650.0, "temp_c_max": 77.0, "rank": 1}]))
    assert len(worst) <= width and "GPU 91-98%" in worst  # several ranks: the range over them


def test_a_wide_console_gets_every_figure_and_a_cpu_the_data_wait() -> None:
    wide = step_line(record(), 160 - TIME_WIDTH, gpu_parts(GPU))
    for part in ("GPU 98%", "690W", "71C", "host wait 0.3%", "412.3 ms/step", "lr 6.00e-04", "gnorm 0.91"):
        assert part in wide
    cpu = step_line(record(step=40, max_steps=600, mfu=None, mem=419.0), 80 - TIME_WIDTH)
    assert cpu.startswith("step 40/600 loss 3.117 1.23M tok/s host wait 0.3% mem 419M") and len(cpu) <= 80 - TIME_WIDTH
    assert "GPU" not in cpu and "host CPU" not in cpu and "RSS" not in cpu
    cuda = step_line({**record(mfu=None), "gpu_starved_pct": 0.4}, 80 - TIME_WIDTH)
    assert "starved 0.4%" in cuda and "host wait" not in cuda  # on CUDA the device's own figure


def test_the_reporter_waits_for_the_monitor_sample_of_its_step(caplog: pytest.LogCaptureFixture) -> None:
    console = Console(file=io.StringIO(), width=80)
    throttled = {**GPU, "throttle_reasons": ["gpu_idle", "sw_power_cap"]}  # idle is no slowdown
    with caplog.at_level(logging.INFO, logger="perfrun"), ConsoleReporter(
            "plain", 5000, console=console, monitor_every=10) as reporter:
        assert caplog.messages == [sinks.PROGRESS_LEGEND]  # which tokens/s the lines show, said once
        reporter.train(record(step=10))
        assert caplog.messages == [sinks.PROGRESS_LEGEND]  # held until this step's GPU sample
        reporter.monitor(10, GPU)
        reporter.train(record(step=15))  # no sample at step 15: printed at once, with the latest figures
        reporter.monitor(20, throttled)
        reporter.monitor(30, throttled)  # still held down: said once
        reporter.monitor(40, GPU)
    lines = caplog.messages[1:]
    assert lines[0].startswith("step 10/5000") and "GPU 98% 690W 71C" in lines[0]
    assert lines[1].startswith("step 15/5000") and "GPU 98%" in lines[1]
    assert lines[2:] == ["step 20: GPU clocks held down (sw_power_cap)", "step 40: GPU clocks no longer held down"]
    assert all(len(line) <= 80 - TIME_WIDTH for line in lines[:2])


def test_a_piped_run_prints_timed_lines_that_fit_and_says_where_its_files_are(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process, its output a captured file descriptor, which is not a terminal, as a
    pipe is not (the pseudo-terminal's real process is the test below). The run gets a
    console of its own, as a process does: rich's shared one, made earlier in this test
    process, keeps the width it was made with."""
    import rich

    monkeypatch.setenv("COLUMNS", "80")
    rich.reconfigure()  # a console made from this environment, as a new process makes it (rich's public call)
    try:
        with kept_logging():
            code = launch("train", *TINY, "progress=auto", "monitor.every_n_steps=5", cwd=tmp_path)
    finally:
        monkeypatch.undo()  # the environment as it was, and the console made from it
        rich.reconfigure()
    r = capfd.readouterr()
    assert code == 0, r.err
    lines = r.out.splitlines()
    (run_dir,) = [p.parent for p in tmp_path.rglob("summary.json")]
    shown = str(run_dir.relative_to(tmp_path))
    assert lines[0].endswith(f"run dir {shown}")
    assert lines[-1].endswith(f"run dir {shown}: checkpoints/, metrics.jsonl, summary.json, train.log")
    assert all(TIMED.match(line) for line in lines), r.out
    steps = [line for line in lines if re.search(rf" step \d+/{TINY_STEPS} loss ", line)]
    assert len(steps) == TINY_STEPS // 5 and all(len(line) <= 80 for line in steps)  # every 5 steps, one line each
    assert not any("monitor step" in line or "host CPU" in line for line in lines)  # a CPU's samples stay in the file
    monitor = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"monitor"' in line]
    assert len(monitor) == TINY_STEPS // 5


@pytest.mark.slow
def test_on_an_80_column_terminal_each_log_point_is_one_line(tmp_path: Path) -> None:
    """A real pseudo-terminal 80 columns wide: rich draws the progress bar, and every step
    line stays on one line (rich would wrap a longer one under its time column)."""
    master, slave = pty.openpty()
    ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 80, 0, 0))
    env = {k: v for k, v in child_env(TERM="xterm-256color").items() if k not in ("COLUMNS", "LINES")}
    args = [a for a in TINY if not a.startswith("progress=")]
    proc = perfrun_process("train", *args, "progress=auto", cwd=tmp_path, env=env, stdin=slave, stdout=slave,
                           stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the process has exited
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=240) == 0, out.decode(errors="replace")
    text = ANSI.sub("", out.decode(errors="replace")).replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n") if line.strip()]
    steps = [i for i, line in enumerate(lines) if re.match(rf"^\d\d:\d\d:\d\d step \d+/{TINY_STEPS} loss", line)]
    assert len(steps) == TINY_STEPS // 5, text
    for i in steps:
        assert len(lines[i]) <= 80 and not lines[i + 1].startswith(" " * TIME_WIDTH)  # no wrapped remainder
    assert any(line.startswith("train ") and f"/{TINY_STEPS}" in line for line in lines)  # the progress bar
