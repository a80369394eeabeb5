"""The suite's perfrun processes forked from a warm interpreter (tests/warm_processes.py) are
processes of their own, with the working directory, environment, pipes and exit status a
fresh ``python -m perfrun`` would have, and a command whose environment a fresh
interpreter would read at start-up gets a fresh one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm_processes
from warm_processes import WarmProcess

import conftest
from conftest import perfrun_process


@pytest.fixture
def server() -> conftest.Server:
    if not conftest._warm:
        pytest.fail("the warm interpreter did not start (see the warning above)")
    return conftest._warm[0]


def test_a_command_under_the_sessions_environment_is_a_warm_child(server: conftest.Server, tmp_path: Path) -> None:
    env = {**server.env, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}  # settings read at run time only
    p = perfrun_process("--version", cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert isinstance(p, WarmProcess) and p.pid != os.getpid()
    assert (p.returncode, out, err) == (0, f"perfrun {__import__('perfrun').__version__}\n", "")
    bad = perfrun_process("trian", cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "unknown command 'trian'" in err and not out


def test_a_warm_child_has_its_own_directory_environment_and_signals(server: conftest.Server, tmp_path: Path) -> None:
    """Hydra records the working directory of ``perfrun train --cfg hydra``; a child sees the
    environment it was given; a child stopped by a signal reports it as Popen does (minus
    the signal)."""
    (tmp_path / "here").mkdir()
    p = perfrun_process("train", "--cfg", "hydra", "seed=7", cwd=tmp_path / "here", env=server.env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=120)
    assert isinstance(p, WarmProcess) and p.returncode == 0 and f"cwd: {tmp_path / 'here'}" in out
    seen = perfrun_process("-n", "1", "-r", "1", "print(__import__('os').environ['COLUMNS'])", cwd=tmp_path,
                           env={**server.env, "COLUMNS": "123"}, stdout=subprocess.PIPE, text=True, module="timeit")
    assert isinstance(seen, WarmProcess) and seen.communicate(timeout=60)[0].splitlines()[0] == "123"
    sleeper = perfrun_process("-n", "1", "-r", "1", "import time; time.sleep(120)", cwd=tmp_path, env=server.env,
                              stdout=subprocess.DEVNULL, module="timeit")  # python -m timeit: a child that waits
    assert isinstance(sleeper, WarmProcess) and sleeper.poll() is None
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL


def test_settings_read_at_start_up_get_a_fresh_interpreter(server: conftest.Server, tmp_path: Path) -> None:
    assert server.serves({**server.env, "COLUMNS": "80", "COMP_LINE": "perfrun t"})
    for key, value in (("PYTHONPROFILEIMPORTTIME", "1"), ("OMP_NUM_THREADS", "7"), ("PYTHONPATH", str(tmp_path)),
                       ("MALLOC_ARENA_MAX", "2"), ("TORCH_LOGS", "dynamo")):
        assert not server.serves({**server.env, key: value}), key
    without = {k: v for k, v in server.env.items() if k != "PYTHONPATH"}
    assert not server.serves(without)
    fresh = perfrun_process("--version", cwd=tmp_path, env={**server.env, "PYTHONWARNINGS": "error"},
                            stdout=subprocess.PIPE, text=True)
    assert isinstance(fresh, subprocess.Popen) and fresh.communicate(timeout=60)[0].startswith("perfrun ")
    assert fresh.args[:3] == [sys.executable, "-m", "perfrun"]


def test_the_launcher_a_warm_child_starts_is_forked_too(server: conftest.Server, tmp_path: Path) -> None:
    """``perfrun train nproc=2`` starts ``python -m perfrun.commands.launch`` (its torchrun) with
    subprocess.Popen, and submitit's local controller starts its job ``python -u -m
    submitit.core._submit`` with an environment of its own: in a warm child each is a warm
    child as well; a command that reads a pipe, or any other command, is not."""
    code = ("import os, subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-m', 'perfrun.commands.launch', '--help'], stdout=subprocess.DEVNULL); "
            "env = {**os.environ, 'SUBMITIT_LOCAL_JOB_ID': '1', 'CUDA_VISIBLE_DEVICES': ''}; "
            "job = [sys.executable, '-u', '-m', 'submitit.core._submit', '--help']; "
            "s = subprocess.Popen(job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, encoding='utf-8'); "
            "t = subprocess.Popen(job, env=env, stdout=subprocess.PIPE, encoding='utf-8'); t.communicate(); "
            "q = subprocess.Popen([sys.executable, '-c', 'pass']); "
            "print(*(f'{type(x).__name__} {x.wait()}' for x in (p, s, t, q)))")
    seen = perfrun_process("-n", "1", "-r", "1", code, cwd=tmp_path, env=server.env, stdout=subprocess.PIPE,
                           text=True, module="timeit")
    submitit = "WarmProcess" if warm_processes._without_cuda() else "Popen"  # CUDA reads CUDA_VISIBLE_DEVICES
    assert seen.communicate(timeout=120)[0].splitlines()[0] == f"WarmProcess 0 {submitit} 0 Popen 0 Popen 0"


ENDINGS = '''
import atexit, sys, threading
atexit.register(print, "atexit")
sys.stdout.write("unflushed ")
ended = threading.Event()  # the thread prints once the module is over: only a join lets it
threading.Thread(target=lambda: (ended.wait(), print("thread"))).start()
how = sys.argv[1]
try:
    if how == "code":
        sys.exit(3)
    if how == "message":
        sys.exit("no way")
    if how == "error":
        raise ValueError("boom")
    if how == "interrupt":
        raise KeyboardInterrupt
finally:
    ended.set()
'''


@pytest.mark.parametrize("how", ["returns", "code", "message", "error", "interrupt"])
def test_a_warm_child_ends_as_a_fresh_interpreter_does(server: conftest.Server, tmp_path: Path, how: str) -> None:
    """Its exit status, what it printed last (its stdout flushed, its threads joined, then
    atexit), and the last line of an uncaught exception's report, as ``python -m`` gives them."""
    (tmp_path / "ending.py").write_text(ENDINGS)
    env = {k: v for k, v in server.env.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    ends = []
    for start in (perfrun_process, None):
        if start is None:
            p = subprocess.Popen([sys.executable, "-m", "ending", how], cwd=tmp_path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        else:
            p = start(how, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      module="ending")
            assert isinstance(p, WarmProcess)
        out, err = p.communicate(timeout=60)
        ends.append((p.returncode, out, err.strip().splitlines()[-1:]))
    assert ends[0] == ends[1]
    expected = {"returns": 0, "code": 3, "message": 1, "error": 1, "interrupt": -signal.SIGINT}[how]
    assert ends[0][:2] == (expected, "unflushed thread\natexit\n")
