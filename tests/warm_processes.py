"""``python -m MODULE ARGS`` processes for the tests (perfrun, its torchrun launcher,
torchrun and torchrun's ranks), forked from a warm interpreter; the launcher and the ranks
that a forked perfrun starts are forked too.

A fresh interpreter spends 4-6 s on 2 cores importing torch, dynamo and Hydra before perfrun
reads its command line; the suite starts a few dozen. This module runs a server process that
has imported them once and forks one child per command. Each child is a real process, as
``subprocess.Popen`` makes one: its own pid, signals, exit code (killed: minus the signal),
pipes or terminal, working directory and environment; it runs the module as ``python -m``
does, and ends as the interpreter ends (atexit, flushes, threads), without its teardown.

What a fresh interpreter reads before running any code (``PYTHON*`` settings, ``OMP_*``,
``LD_*``, ``MALLOC_*``, torch's settings, another ``PYTHONPATH``...) the warm one has already
read: a command whose environment differs from the server's in anything but the runtime
settings below starts a fresh interpreter, as before.

Run as a script, this file is the server: ``python warm_processes.py SOCKET ALIVE_FD [MODELS]``
(it ends when the pipe ``ALIVE_FD`` reads is closed; MODELS, a JSON list of lists of model
overrides: their FLOPs are counted before any child is forked, see :func:`_count_flops`).
"""

from __future__ import annotations

import functools
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

# read by perfrun, Hydra, rich or torch while they run, never at import: a child may have its
# own. PYTEST_CURRENT_TEST: set by pytest for each test, read by none of them;
# set in this process while a test runs, and so passed on to every command started after it:
# TORCHINDUCTOR_CACHE_DIR by torch once it looks for its cache (read each time it does),
# _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR by inductor around a compiled CPU kernel's call
# (read by that call), KINETO_LOG_LEVEL by perfrun's memory breakdown before the profiler's
# first start (read when the profiler starts, which the warm interpreter never does).
RUNTIME_ENV = frozenset({"COLUMNS", "LINES", "TERM", "NO_COLOR", "FORCE_COLOR", "COMP_LINE", "COMP_POINT",
                         "HYDRA_FULL_ERROR", "PYTHONUNBUFFERED", "PERFRUN_CACHE", "PYTEST_CURRENT_TEST",
                         "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KINETO_LOG_LEVEL"})
# set by torchrun for each of its ranks (or in its own process, which they inherit), read by
# torch.distributed and perfrun when a rank joins its group
RANK_ENV = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                      "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# set by submitit for its local job controller and each job process (hydra/launcher=slurm_local),
# read by submitit while the job runs (the warm interpreter never imports submitit); set by
# pytest-xdist in each of its workers, read by pytest-xdist alone (a worker's commands and
# the controller that started the server differ in them and in nothing else)
RUNTIME_PREFIXES = ("SUBMITIT_", "PYTEST_XDIST_")
# read by CUDA when torch first asks for a device: where this torch has no CUDA, nobody reads it
CUDA_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})


@functools.cache
def _without_cuda() -> bool:
    """Whether this torch has no CUDA (asked once: it cannot change while the process runs)."""
    import torch

    return torch.version.cuda is None and not torch.cuda.is_available()


PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "hydra", "perfrun.commands.dispatch",
           "perfrun.commands.train", "perfrun.loop.run")


class Server:
    """The warm interpreter of a test run, started with the environment ``env``: by the
    process that runs the tests, or under pytest-xdist by its controller, whose workers
    attach to the one server (:meth:`attach`, then :meth:`wait`)."""

    alive: int | None  # the pipe's end whose closing ends the server; None where another process started it

    def __init__(self, folder: Path, env: dict[str, str], counted: list[list[str]] | None = None, *,
                 wait: bool = True) -> None:
        self.env = dict(env)
        self.folder = folder
        self.path = str(folder / "warm.sock")
        self.printed = ""
        alive, self.alive = os.pipe()  # the server ends when this end closes: with this process
        with (folder / "warm.log").open("w") as out:  # the server is a grandchild (a daemon), so that it is no child
            starter = subprocess.Popen([sys.executable, __file__, self.path, str(alive), json.dumps(counted or [])],
                                       env=self.env,  # here
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=[alive])
        os.close(alive)
        starter.wait()
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the server listens (once its imports are done); RuntimeError if it failed."""
        log = self.folder / "warm.log"
        end = time.monotonic() + 120
        while not os.path.exists(self.path):
            said = log.read_text() if log.exists() else None
            if said is None or "Traceback" in said or time.monotonic() > end:
                self.close()
                raise RuntimeError(f"the warm interpreter did not start: "
                                   f"{'its folder is gone' if said is None else said[-2000:]}")
            time.sleep(0.01)
        # a fresh interpreter prints what its imports print (a warning, say) before perfrun's
        # own output: where the warm one's imports printed anything, its children would not
        self.printed = log.read_text()

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` behaves as a fresh interpreter with it would."""
        keys = {k for k in set(env) | set(self.env) if not k.startswith(RUNTIME_PREFIXES)} - RUNTIME_ENV - RANK_ENV
        if _without_cuda():
            keys -= CUDA_ENV
        return not self.printed and all(env.get(k) == self.env.get(k) for k in keys)

    @classmethod
    def attach(cls, path: str, env: dict[str, str]) -> Server:
        """The server another process started (this process's parent, or pytest-xdist's
        controller), as ``env`` started it; this process never ends it."""
        server = cls.__new__(cls)
        server.folder, server.path, server.env, server.printed, server.alive = Path(path).parent, path, env, "", None
        return server

    def close(self) -> None:
        """End the server (it sees the pipe close) and remove its folder, log and socket; for
        the process that started it only."""
        if self.alive is None:
            return
        os.close(self.alive)
        self.alive = None
        shutil.rmtree(self.folder, ignore_errors=True)


def _fd(stream: Any, default: int) -> tuple[int, int | None]:
    """(the fd the child gets, the read end kept here for a pipe)."""
    if stream is None:
        return default, None
    if stream is subprocess.PIPE:
        read, write = os.pipe()
        return write, read
    if stream is subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    return (stream if isinstance(stream, int) else stream.fileno()), None


class WarmProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of the warm interpreter."""

    def __init__(self, server: Server, args: list[str], *, cwd: Path | str, env: dict[str, str],
                 stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False,
                 module: str = "perfrun", unbuffered: bool = False, new_session: bool = False) -> None:
        if stdin is subprocess.PIPE:
            raise ValueError("a warm process reads no pipe from here: give stdin a file, a descriptor or nothing")
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        ends = [_fd(stdin, 0), _fd(stdout, 1), _fd(stderr, 2)]
        self.stdin = None
        self.stdout, self.stderr = (self._reader(read, text) for _, read in ends[1:])
        request = json.dumps({"module": module, "args": args, "cwd": str(cwd), "env": env, "unbuffered": unbuffered,
                              "new_session": new_session}).encode()
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(server.path)
        socket.send_fds(self.conn, [len(request).to_bytes(8, "big") + request], [fd for fd, _ in ends])
        for (fd, read), given in zip(ends, (stdin, stdout, stderr), strict=True):
            if read is not None or given is subprocess.DEVNULL:
                os.close(fd)  # the child holds its own copy
        self.pid = self._line()

    def _line(self) -> int:
        """The server's next line (a pid, then an exit code), read byte by byte: nothing is
        buffered here beyond it, so that select() on the socket says whether one is waiting."""
        data = b""
        while not data.endswith(b"\n"):
            byte = self.conn.recv(1)
            if not byte:
                raise RuntimeError("the warm interpreter ended before the process it started")
            data += byte
        return int(data)

    @staticmethod
    def _reader(fd: int | None, text: bool) -> IO[Any] | None:
        return None if fd is None else open(fd, "r" if text else "rb")  # noqa: SIM115 - closed by communicate

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self.returncode = self._line()
            self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._line()
            self.conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Both pipes read to their end, then the exit code (as Popen.communicate)."""
        end = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
        chunks: dict[Any, list[bytes]] = {s: [] for s in streams}
        while streams:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready = select.select(streams, [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for s in ready:
                data = os.read(s.fileno(), 65536)
                if data:
                    chunks[s].append(data)
                else:
                    streams.remove(s)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        out = []
        for s in (self.stdout, self.stderr):
            if s is None or s not in chunks:
                out.append(None)
                continue
            data = b"".join(chunks[s])  # text as Popen gives it: decoded, universal newlines
            out.append(data.decode().replace("\r\n", "\n").replace("\r", "\n") if isinstance(s, io.TextIOWrapper)
                       else data)
            s.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the server: runs in the warm interpreter ----------------------------------------------


def _serve(path: str, alive: int) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request and report its exit code; returns (the request, its fds) in
    the child, None once ``alive`` is closed (the process that started this server ended).
    It sleeps until a request comes, ``alive`` closes or a child ends (each child's pidfd)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the path appears once the server listens
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, the requester's connection)
    while True:
        ready = select.select([listener, alive, *children], [], [])[0]
        if alive in ready and not os.read(alive, 1):
            break
        for pidfd in (fd for fd in ready if fd in children):
            pid, conn = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the test stopped listening
                pass
            conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            size = int.from_bytes(data[:8], "big")
            while len(data) < 8 + size:
                data += conn.recv(1 << 16)
            pid = os.fork()
            if pid == 0:
                listener.close()
                os.close(alive)
                for pidfd, (_, c) in children.items():
                    os.close(pidfd)
                    c.close()
                conn.close()
                return json.loads(data[8:]), fds
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[os.pidfd_open(pid)] = (pid, conn)
    try:
        os.unlink(path)
    except FileNotFoundError:  # the process that started the server removed its folder first
        pass
    return None


def _ranks_forked_here(server: Server) -> None:
    """torchrun's ranks (``python -u -m perfrun ...``, each in a session of its own) forked from
    this server too, where their environment is the server's but for what torchrun sets."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    fresh = subprocess_handler.SubprocessHandler._popen

    def popen(handler: Any, args: tuple[str, ...], rank_env: dict[str, str]) -> Any:
        if list(args[:4]) != [sys.executable, "-u", "-m", "perfrun"] or not server.serves(rank_env):
            return fresh(handler, args, rank_env)
        return WarmProcess(server, list(args[4:]), cwd=os.getcwd(), env=rank_env, stdout=handler._stdout,
                           stderr=handler._stderr, unbuffered=True, new_session=True)

    subprocess_handler.SubprocessHandler._popen = popen


# what perfrun and the launchers it drives start with subprocess.Popen, forked where allowed:
# perfrun's torchrun (run_torchrun's), and for hydra/launcher=slurm_local submitit's local job
# controller and the job process it starts
LAUNCHERS = ("perfrun.commands.launch", "submitit.local._local", "submitit.core._submit")


def _launcher(cmd: Any) -> tuple[str, list[str], bool] | None:
    """(module, its arguments, whether unbuffered) of ``[python, (-u,) -m, MODULE, ARGS...]``
    for a module of LAUNCHERS; None for any other command."""
    if not isinstance(cmd, list) or not cmd or cmd[0] != sys.executable:
        return None
    words = cmd[1:]
    unbuffered = words[:1] == ["-u"]
    words = words[unbuffered:]
    if len(words) < 2 or words[0] != "-m" or words[1] not in LAUNCHERS:
        return None
    return words[1], list(words[2:]), unbuffered


def launchers_forked(server: Server, popen: Any) -> Any:
    """``subprocess.Popen`` in which a command of LAUNCHERS (started as its caller starts it:
    the list, at most ``stdout``, ``stderr`` (no pipe), ``env`` and ``encoding``, which only a
    pipe reads, and this process's working directory) is forked from ``server`` where the
    environment allows it; every other command goes to ``popen``."""
    def start(cmd: Any, *rest: Any, **kw: Any) -> Any:
        found = _launcher(cmd)
        env = dict(os.environ if kw.get("env") is None else kw["env"])
        plain = (not rest and set(kw) <= {"stdout", "stderr", "env", "encoding", "shell"} and not kw.get("shell")
                 and subprocess.PIPE not in (kw.get("stdout"), kw.get("stderr")))
        if found is None or not plain or not server.serves(env):
            return popen(cmd, *rest, **kw)
        module, args, unbuffered = found
        return WarmProcess(server, args, cwd=os.getcwd(), env=env, stdout=kw.get("stdout"), stderr=kw.get("stderr"),
                           module=module, unbuffered=unbuffered)

    return start


def _stdio(fd: int, write: bool, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    """A standard stream over ``fd`` as a fresh interpreter makes it (line-buffered on a
    terminal and for stderr, unbuffered under PYTHONUNBUFFERED)."""
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    if not write:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=sys.stdin.encoding, errors=errors)
    buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffer, encoding=sys.stdout.encoding, errors=errors, write_through=unbuffered,
                            line_buffering=not unbuffered and (raw.isatty() or fd == 2))


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """This child, made the process ``python -m MODULE ARGS`` would be."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if request["new_session"]:  # as Popen(start_new_session=True)
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))  # python -u, or the setting
    sys.stdin = sys.__stdin__ = _stdio(0, False, unbuffered, sys.stdin.errors)
    sys.stdout = sys.__stdout__ = _stdio(1, True, unbuffered, sys.stdout.errors)
    sys.stderr = sys.__stderr__ = _stdio(2, True, unbuffered, sys.stderr.errors)
    sys.path[0] = os.getcwd()  # python -m puts the working directory first
    sys.argv = ["-m", *request["args"]]


def _exit_code(code: Any) -> int:
    """The exit status ``raise SystemExit(code)`` gives the interpreter (its message printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _count_flops(models: list[list[str]]) -> None:
    """Count the training FLOPs of each model (``perfrun train`` overrides) on one item, as a
    run's setup does: a child that runs one of them finds it counted, as the second job of a
    sweep does in one process. The count is made on fake tensors, though a run counts a model
    this small on real ones (the same figure), so that any child finds FakeTensorMode's first
    use in a process done (0.4 s of CPU after these imports, for the child's memory estimate)."""
    from unittest import mock

    import torch
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, typed
    from perfrun.models import flops
    from perfrun.models.build import build_model

    for overrides in models:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
            cfg = typed(compose("train", overrides=overrides))
        vocab = int(cfg.data.vocab_size)
        seq_len = int(cfg.data.seq_len or cfg.model.block_size)
        item = torch.zeros(seq_len, dtype=torch.int64)
        with mock.patch.object(flops, "REAL_PASS_FLOPS", 0):
            flops.flops_figure(build_model(cfg.model, vocab, cfg.attention), (item, item), seq_len)


def _frozen_frames_found() -> None:
    """Enter each frozen module in :mod:`inspect`'s cache of modules by file, under the name its
    frames carry (``<frozen runpy>``): inspect finds no module for such a frame and scans all
    of ``sys.modules`` again at each lookup, up to three a frame. Every ``python -m`` runs
    under two runpy frames, and this server holds ~2,300 modules (a fresh torchrun ~1,350):
    ``inspect.stack()`` in a child took 28-35 ms on the 2-core EPYC (its first call 66-100
    ms), 2 ms with the entries. torchrun's rendezvous calls it twice for each event it
    records: 1.7 s of a 2-rank torchrun forked here (py-spy). What inspect returns for these
    frames is unchanged: no source lines (linecache reads none for a ``<...>`` name)."""
    import inspect

    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.origin == "frozen":
            inspect.modulesbyfile[f"<frozen {name}>"] = name


def _run_and_end(module: str) -> None:
    """Run ``module`` as ``python -m`` does and end as its interpreter ends (an uncaught
    exception's traceback, non-daemon threads joined, atexit, the streams flushed, the exit
    status, SIGINT re-raised after an uncaught KeyboardInterrupt), but without the teardown
    that follows: freeing every object one by one, it writes to each page this child shares
    with the server, which the kernel then copies: a child that runs nothing took 0.39-0.50 s
    of CPU on a 2-core EPYC with it, 0.06-0.09 s without (the system takes the memory back
    at exit all the same)."""
    import atexit
    import runpy
    import threading

    interrupted = False
    try:
        runpy._run_module_as_main(module)  # what python -m MODULE runs
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(type(e), e, e.__traceback__)
        interrupted, code = isinstance(e, KeyboardInterrupt), 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the interpreter's status for it
            code = 120
    if interrupted:  # as the interpreter ends after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    if os.fork() > 0:  # the starter ends at once; the server goes on as its child, adopted by init
        os._exit(0)
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import warnings

    import hydra_cache  # this script's folder (tests/) comes first on sys.path

    with warnings.catch_warnings():  # the test process says it where this Hydra's are not kept
        warnings.simplefilter("ignore")
        hydra_cache.install()
    if hydra_cache.active():
        hydra_cache.warm()
    _count_flops(json.loads(sys.argv[3]))
    from perfrun.data.pysource import pysource_files, stdlib_dir

    pysource_files(stdlib_dir())  # listed once per process, as data=pysource (the default) lists it
    _frozen_frames_found()
    here = Server.attach(sys.argv[1], dict(os.environ))  # as this server's children reach it
    _ranks_forked_here(here)
    subprocess.Popen = launchers_forked(here, subprocess.Popen)  # type: ignore[misc]
    gc.collect()
    gc.freeze()  # what the imports made stays out of each child's collections (see conftest)
    served = _serve(sys.argv[1], int(sys.argv[2]))
    if served is None:
        raise SystemExit(0)
    _become(*served)
    module = served[0]["module"]
    del served
    _run_and_end(module)
