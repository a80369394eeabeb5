"""Shared fixtures: compose a real configuration from conf/ and run small jobs on the CPU."""

from __future__ import annotations

import compileall
import contextlib
import copy
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from perfrun.config import TrainConfig

# torch, Hydra and perfrun are imported by what uses them, not here: under pytest -n the
# process that hands tests to the workers runs none of it, and the workers start ~2.5 s
# sooner (on 2 cores) when it has not imported torch first.

REPO = Path(__file__).resolve().parent.parent

# A machine that sets PYTHONDONTWRITEBYTECODE (some images do) would have each of the ~60
# processes the suite starts compile perfrun from source again (~1 s each on 2 cores), and
# each test worker rewrite and compile every test file. perfrun is compiled once here, the
# test files are cached as pytest caches them; the variable itself is left to the processes.
if sys.dont_write_bytecode:
    compileall.compile_dir(REPO / "perfrun", quiet=1)
    sys.dont_write_bytecode = False

# A model small enough that a 20-step job takes well under a second. Its jobs leave the heap
# as they find it (runtime.gc=default): the file-level freeze below already keeps what is alive
# out of the collector's sight, and a job with runtime.gc=freeze would only find it frozen,
# counting the frozen objects to say so (gc.get_freeze_count walks every one of them).
# tests/test_runtime.py runs jobs with perfrun train's freeze.
TINY_MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
TINY = [
    *TINY_MODEL, "dataloader.batch_size=4", "max_steps=20", "log_every=5", "eval_every=0", "eval_batches=2",
    "monitor.every_n_steps=0", "device=cpu", "progress=off", "optim.warmup_steps=5", "runtime.gc=default",
]


# The job tests/test_distributed.py and tests/test_fsdp.py run on 2 ranks (x batch 2) and in one
# process (x batch 4, the same global batch), with 2 micro-steps.
RANKS_COMMON = [*TINY_MODEL, "max_steps=6", "log_every=1", "eval_every=0", "eval_batches=2", "device=cpu",
                "progress=off", "monitor.every_n_steps=0", "optim.warmup_steps=2", "accumulation.steps=2"]


# The test files that take longest, slowest first (the CPU seconds of their tests, setup
# included, in one run of the whole suite: docs/test-suite.md; those of 2 s or more). Two
# xdist workers handed the longest files first end together (with xdist's own order, most
# tests first, a long file of one test came last and one worker waited for the other).
# Files not named follow, most tests first. A stale list costs balance, never a test.
SLOW_FIRST = ("test_reliability.py", "test_fsdp.py", "test_memory_knobs.py", "test_distributed.py", "test_hf_models.py",
              "test_cli.py", "test_translations.py", "test_nothing_lost.py", "test_recorded_code.py", "test_verdict_paste.py",
              "test_options_as_typed.py",
              "test_sweep.py", "test_gpu_bench_scripts.py", "test_estimate.py", "test_generate.py", "test_tune.py",
              "test_train.py", "test_llama.py", "test_ladder_once.py", "test_cluster_launcher.py",
              "test_bench_train.py", "test_export.py", "test_prepare.py", "test_loggers.py", "test_sweep_stop.py",
              "test_untrusted_files.py", "test_sweep_time.py", "test_batch_size.py", "test_custom_model.py",
              "test_console.py", "test_data.py", "test_gpucheck.py", "test_ladder.py", "test_speed_knobs.py",
              "test_contract.py", "test_host_heap.py", "test_flops.py", "test_verdict.py", "test_plots.py")


def pytest_configure(config: Any) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def _file(item: Any) -> str:
    return Path(str(item.nodeid).split("::", 1)[0]).name


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    rank = {name: k for k, name in enumerate(SLOW_FIRST)}
    tests = Counter(_file(item) for item in items)
    items.sort(key=lambda item: (rank.get(_file(item), len(rank)), -tests[_file(item)], _file(item)))  # stable
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One data cache for the whole session, out of the user's home."""
    os.environ["PERFRUN_CACHE"] = str(tmp_path_factory.mktemp("perfrun-cache"))


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_process() -> Iterator[None]:
    """Every job of the suite, in this process or started by it, on one thread: tiny models
    run fastest so, and two test workers on 2 cores (``pytest -n 2``) would otherwise make
    twice as many OpenMP threads spin against each other (up to 100x slower). A caller's own
    OMP_NUM_THREADS is kept."""
    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(env or 1))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # run_cli, start_train, torchrun and their ranks
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """What a test puts in os.environ stays in that test (its own setenv, or what a library a
    job calls sets for itself): a later test's commands inherit this process's environment.
    perfrun's own switches are set for the call that needs them and unset after
    (``perfrun.environment.environment_default``; test_loggers checks MLflow's)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def _root_logger_as_it_was() -> Iterator[None]:
    """A Hydra app run in this process configures the root logger for its job (a console
    handler, the job's train.log): a later test's logging must not write into a folder an
    earlier test made (and may have removed)."""
    from perfrun.console import kept_logging

    with kept_logging():
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_compiled_code_between_files() -> Iterator[None]:
    """What a test file compiles stays in that file: tests that check a job leaves torch's
    global state as it found it must not see another file's compiled frames."""
    yield
    import torch._dynamo

    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _heap_given_back_at_the_end() -> Iterator[None]:
    """The suite's freezes (below) are undone when the session ends."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def _live_objects_out_of_the_collectors_sight() -> None:
    """Every job ends with a full ``gc.collect()`` (``perfrun.loop.run._release``), which walks
    every live object: with torch, dynamo and Hydra loaded, ~0.4 s a job, more than a tiny job
    trains. What is alive when a test file starts (modules, session fixtures) is frozen
    (``gc.freeze``) after one collection, dynamo's modules with them (every job imports them
    to count its FLOPs); what the file's tests make is still collected. The next file's
    collection then walks only what this file left alive, not the whole heap again: the
    freezes add up and are undone once, at the session's end (a cycle that was alive when it
    was frozen and dies later is kept until then). A job finds the heap frozen and leaves it
    so (``runtime.gc=freeze`` says "frozen already"): tests/test_runtime.py unfreezes to run
    jobs as ``perfrun train`` runs them, then freezes again."""
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and a second process on this 2-core box
    (a parallel test run) makes two OpenMP threads spin against it (100x slower). The
    session already runs on one thread (``_one_thread_per_process``); this keeps a module
    on one even where the caller's OMP_NUM_THREADS asks for more."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """RANKS_COMMON in one process with batch 4: the losses, weights and summary that 2 DDP or
    FSDP ranks must match. Trained once per session (each xdist worker has its own); the tests
    only read its run dir (its last checkpoint is step 6)."""
    from perfrun.loop.run import run

    run_dir = tmp_path_factory.mktemp("one-process")
    return run_dir, run(make_cfg(*RANKS_COMMON, "dataloader.batch_size=4"), run_dir)


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint from a short run on byte-level text (this repo's own source), with
    bias-free linears (an export fills GPT-2's biases with zeros): what test_generate.py and
    test_export.py read. Trained once per session; the tests only read its run folder."""
    from perfrun.checkpoint import files as checkpoint_files
    from perfrun.loop.run import run

    folder = tmp_path_factory.mktemp("text-run")
    source = tmp_path_factory.mktemp("text") / "perfrun"  # the tracked files: __pycache__ changes as tests import
    shutil.copytree(REPO / "perfrun", source, ignore=shutil.ignore_patterns("__pycache__"))
    run(make_cfg("max_steps=12", "checkpoint.every_n_steps=12", "data=text", f"data.path={source}",
                 "eval_batches=1", "model.bias=false"), folder)
    return checkpoint_files.list_checkpoints(folder / "checkpoints")[-1]


@functools.cache
def _typed(overrides: tuple[str, ...]) -> TrainConfig:
    """train.yaml composed by Hydra's compose API with ``overrides``, then typed. Kept per
    test process for the same overrides (the result of a public call, never Hydra's state);
    a composition that fails raises again next time."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, register_configs, typed

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return typed(compose("train", overrides=list(overrides)))


def make_cfg(*overrides: str, tiny: bool = True) -> TrainConfig:
    """A job's configuration as ``perfrun train`` makes it: composed from conf/ by Hydra's
    compose API, then typed (``TINY`` first unless ``tiny=False``). A copy: a test may change it."""
    return copy.deepcopy(_typed(tuple((TINY if tiny else []) + list(overrides))))


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's PYTHONPATH holds (the GPU machine
    keeps Hydra there)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def child_env(**settings: str) -> dict[str, str]:
    """This process's environment for a command it starts, with this checkout first on
    PYTHONPATH and ``settings`` added."""
    return {**os.environ, "PYTHONPATH": _pythonpath(), **settings}


def perfrun_process(*args: str, cwd: Path | str, env: dict[str, str] | None = None, stdin: Any = None,
                    stdout: Any = None, stderr: Any = None, text: bool = False,
                    module: str = "perfrun") -> subprocess.Popen:
    """``python -m MODULE ARGS`` (perfrun by default) as a fresh process of its own, as a user
    starts it; ``env``: the whole environment (by default this process's, with this checkout
    first on PYTHONPATH)."""
    env = child_env() if env is None else env
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                            stderr=stderr, text=text)


def run_cli(*args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None,
            module: str = "perfrun") -> subprocess.CompletedProcess:
    """``perfrun ARGS`` (``python -m MODULE ARGS``) in a real subprocess, as a user runs it."""
    full_env = {**child_env(COLUMNS="200"), **(env or {})}
    return _completed(perfrun_process(*args, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, module=module), timeout)


def _completed(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """What ``subprocess.run`` returns for ``proc``, its output piped: killed at the timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch(*args: str, cwd: Path) -> int:
    """``perfrun ARGS`` with the dispatcher called in this process (a process start fewer than
    :func:`run_cli`): what it starts (torchrun and its ranks) are real fresh processes that
    import this checkout. Its exit code."""
    from perfrun.commands.dispatch import main as cli_main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("PYTHONPATH", _pythonpath())
        try:
            return cli_main(list(args))
        except SystemExit as e:  # Hydra's app exits through SystemExit
            return int(e.code or 0)


def start_train(cwd: Path, *args: str) -> subprocess.Popen:
    """``perfrun train args`` as a separate process, its output piped, for a test to signal or kill."""
    env = child_env(PYTHONUNBUFFERED="1")
    return perfrun_process("train", *args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate: Any, timeout: float = 120) -> None:
    """Poll ``predicate`` until it holds; a generous timeout only against a hang."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError
        time.sleep(0.005)


def torchrun(cwd: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=N -m perfrun train ARGS``, as a user starts it by hand."""
    env = child_env(COLUMNS="200")
    return _completed(perfrun_process("--standalone", f"--nproc_per_node={nproc}", "-m", "perfrun", "train", *args,
                                      cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      module="torch.distributed.run"), 240)


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``64k``) mounted at ``folder``, made here: a disk that fills
    up for real. The test is skipped where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.decode().strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def fill(disk: Path) -> None:
    """Write into ``disk`` until it is full."""
    with (disk / ".filler").open("wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(64 * 1024))
        except OSError:
            pass  # full: what it is for


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> train loss, from a run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}
