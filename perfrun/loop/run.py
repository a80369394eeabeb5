"""One training job from start to summary.json: locks, sinks, setup, the schedule, and a
true status whatever happens.

``run`` -> ``setup`` (device, seed, data, model, knobs -> the plan, optimizer, loaders) ->
``build_loop`` (the train step, step metrics, guard, evaluator, checkpointer) -> the
checkpointer resumes -> ``train_loop`` calls each part in order, and each part decides its
own cadence -> summary.json. The loop names no knob: what a knob changes, the plan carries.
"""

from __future__ import annotations

import errno
import gc
import logging
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from perfrun import distributed
from perfrun.checkpoint.atomic import write_json
from perfrun.checkpoint.checkpointer import Start
from perfrun.checkpoint.files import CheckpointWriteError, check_writable
from perfrun.checkpoint.resume_search import RunSearch
from perfrun.checkpoint.run_lock import RunRecord, locked
from perfrun.config import ConfigError, TrainConfig
from perfrun.console import first_line
from perfrun.environment import environment, global_state, rank_info
from perfrun.loop.runtime import frozen_heap
from perfrun.loop.schedule import Loop, build_loop, train_loop
from perfrun.loop.setup import Resolved, setup
from perfrun.loop.stopping import GracefulStop, Interrupted
from perfrun.models.pretrained import with_folder_shape
from perfrun.summary import RunSummary
from perfrun.telemetry import contention
from perfrun.telemetry.loggers import build_sinks
from perfrun.telemetry.profiling import attach_profiler, dump_memory_snapshot
from perfrun.telemetry.sinks import ConsoleReporter, RecordSink, data_figure

if TYPE_CHECKING:
    from perfrun.memory.found_batches import FoundBatches

log = logging.getLogger("perfrun")


class RunFailed(RuntimeError):
    """A run that stopped for a reason the user can act on (out of memory, ...)."""


def run(cfg: TrainConfig, run_dir: Path | None, *, overrides: list[str] | None = None,
        search: RunSearch | None = None, sweep_args: Sequence[str] = (),
        found: FoundBatches | None = None) -> RunSummary:
    """One training job. Writes metrics.jsonl and summary.json into ``run_dir`` (rank 0).

    Raises ConfigError or RunFailed (after writing a ``failed`` summary) for what the user
    can fix, and for anything unexpected (its traceback goes to train.log); Interrupted
    (after an ``interrupted`` summary and a checkpoint) on SIGINT/SIGTERM; the caller turns
    them into one line and an exit code. A job refused before its first step writes no
    summary over one already in ``run_dir``; ``search``: where and for what configuration
    ``resume=auto`` looks for the run to continue when ``run_dir`` holds no checkpoint;
    ``sweep_args``: the command line of the sweep this job is part of (its logger's names);
    ``found``: the sweep's batch searches so far (``batch_size=auto``), which this job may reuse.
    """
    with frozen_heap(cfg.runtime) as gc_done:  # runtime.gc, for the whole job, its last collection included
        return _job(cfg, run_dir, gc_done, overrides=overrides, search=search, sweep_args=sweep_args, found=found)


def _job(cfg: TrainConfig, run_dir: Path | None, gc_done: dict[str, Any], *, overrides: list[str] | None,
         search: RunSearch | None, sweep_args: Sequence[str], found: FoundBatches | None) -> RunSummary:
    rank, world = rank_info()
    main = rank == 0
    t_start = time.perf_counter()
    state_at_start = global_state()
    summary: RunSummary = {"status": "running", "overrides": list(overrides or []), "rank": rank, "world_size": world,
                           "runtime": dict(gc_done)}
    record = RunRecord(run_dir if main else None)
    resolved = Resolved()
    sink: RecordSink | None = None
    device: torch.device | None = None
    try:
        cfg = with_folder_shape(cfg)  # model=llama model.init_from=FOLDER: the folder's shape
        with ExitStack() as stack, GracefulStop() as stop:
            _hold_folders(cfg, run_dir, stack)
            record.owned = True
            sink = build_sinks(cfg, run_dir, rank, sweep_args)  # metrics.jsonl and the experiment logger, on rank 0
            built = setup(cfg, stack, resolved, found, job=f"the job in {run_dir}")
            device = built.device
            summary.update(built.facts)
            summary["runtime"] = {**gc_done, **built.facts["runtime"]}
            summary["environment"] = environment(device)
            reporter = ConsoleReporter(cfg.progress, cfg.max_steps, enabled=main, monitor_every=cfg.monitor.every_n_steps)
            loop = build_loop(cfg, built, run_dir, sink, reporter, stop, search)
            stop.refuse_during_setup()  # Ctrl-C or SIGTERM during setup: nothing to save yet
            start = loop.checkpointer.resume(cfg.resume)
            _mark_start(summary, sink, record, start)
            attach_profiler(cfg, device, built.plan, stack, run_dir, record=main)  # rank 0 records
            summary["setup_s"] = time.perf_counter() - t_start
            loop.metrics.start_monitor(cfg.monitor, device, stack)
            with reporter:
                summary.update(_train(cfg, loop, start, run_dir, snapshot=bool(built.facts["memory_snapshot"] and main),
                                      batch_size=resolved.batch_size))
            # did this job have the machine to itself? (the monitor's figures, else the host's over the steady steps)
            summary["contention"] = contention.assess(contention.job_figures(summary.get("monitor"),
                                                                             summary.get("host_load")))
            if main:
                contention.say(summary["contention"])
            if built.facts["memory_snapshot"] and main:
                summary["memory_snapshot_path"] = dump_memory_snapshot(run_dir, "end of the job")
            del built, loop
        _raise_unless_completed(summary, _continue_hint(summary, run_dir))
        summary["status"] = "completed"
        return summary
    except (ConfigError, RunFailed) as e:
        summary["status"] = "failed"
        summary["reason"] = str(e)
        raise
    except Interrupted as e:
        summary["status"] = "interrupted"
        summary.setdefault("reason", str(e))
        raise
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        summary["reason"] = "stopped at once by a second SIGINT; the current step was not saved"
        raise Interrupted(signal.SIGINT, summary["reason"]) from None
    except Exception as e:  # noqa: BLE001 - anything else still ends the run with a true status and one line
        summary["status"] = "failed"
        summary["reason"] = unexpected_reason(e)
        _traceback_to_log_files(e)
        where = f"; the traceback is in {run_dir / 'train.log'}" if run_dir is not None else ""
        raise RunFailed(f"the run failed: {summary['reason']}{where}") from e
    finally:
        if summary["status"] == "running":  # a BaseException none of the above names (sys.exit in user code)
            summary["status"] = "failed"
            summary["reason"] = unexpected_reason(sys.exc_info()[1] or RuntimeError("the job ended without a status"))
        _release(device)
        summary["global_state_at_start"] = state_at_start
        summary["global_state_after"] = global_state()
        summary["wall_s"] = time.perf_counter() - t_start
        summary["config"] = resolved.config_record(cfg)  # as composed, with what setup found out
        summary["resolved"] = resolved.summary()
        unwritten = _write_summary(summary, record, run_dir) if main and run_dir is not None else None
        if sink is not None:
            sink.close(summary)  # the loggers end their runs with it
        if summary["status"] == "completed":
            _log_summary(summary)
        if unwritten is not None and summary["status"] == "completed":
            raise RunFailed(unwritten)


def _hold_folders(cfg: TrainConfig, run_dir: Path | None, stack: ExitStack) -> None:
    """Rank 0 locks the run dir and checkpoint.dir for the life of the job (one job per
    folder); every rank stops with the same line when another job holds one."""
    problem = None
    if distributed.rank() == 0:
        try:
            if run_dir is not None:
                _lock(run_dir, "hydra.run.dir", stack)
            if cfg.checkpoint.dir:
                check_writable(Path(cfg.checkpoint.dir))
                _lock(Path(cfg.checkpoint.dir), "checkpoint.dir", stack)
        except ConfigError as e:
            problem = str(e)
    problem = distributed.from_rank0(problem)
    if problem is not None:
        raise ConfigError(problem)


def _lock(folder: Path, what: str, stack: ExitStack) -> None:
    try:
        stack.enter_context(locked(folder, what))
    except OSError as e:
        raise ConfigError(f"{what}={folder} is not writable ({e.strerror or e}); set {what} to a writable folder") from None


def _mark_start(summary: RunSummary, sink: RecordSink, record: RunRecord, start: Start) -> None:
    """From here the job trains, and its summary stands. A resume (or a run into a run dir
    that held one) puts a ``start`` record into metrics.jsonl: a reader drops the rows before
    it of the steps after ``step``, which are trained again."""
    record.trained = True
    summary["resumed_from"] = start.checkpoint
    summary["resumed_from_step"] = start.step if start.checkpoint else None
    if start.checkpoint or record.previous is not None:
        sink.write({"kind": "start", "step": start.step, "resumed_from": start.checkpoint})


def _write_summary(summary: RunSummary, record: RunRecord, run_dir: Path) -> str | None:
    """summary.json, unless the job was refused where a summary already stands; the one-line
    reason when it cannot be written (a full disk)."""
    shown = record.to_write(summary)
    if shown is None:
        return None
    try:
        write_json(run_dir / "summary.json", shown)
    except OSError as e:
        message = f"could not write {run_dir / 'summary.json'}: {e.strerror or first_line(e)}; free space on that disk"
        log.error(message)
        return message
    return None


def unexpected_reason(e: BaseException) -> str:
    """What a user reads of an exception perfrun did not foresee: its kind and first line
    (a full disk said as such)."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"the disk is full ({e.filename or 'writing the run'}); free space and resume with resume=auto"
    return f"{type(e).__name__}: {first_line(e)}"


def _traceback_to_log_files(e: BaseException) -> None:
    """The traceback into train.log (the log files), not onto the console."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "unexpected error: %s", (first_line(e),),
                            (type(e), e, e.__traceback__))
    for handler in logging.getLogger().handlers + log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _train(cfg: TrainConfig, loop: Loop, start: Start, run_dir: Path | None, *, snapshot: bool,
           batch_size: int | None) -> RunSummary:
    """The loop, with out of memory and a failed save turned into a RunFailed with the fix
    (and, with ``snapshot``, the allocator history written beside it)."""
    try:
        return train_loop(loop, start)
    except torch.OutOfMemoryError:
        message = _oom_message(cfg, loop.train_step.device, batch_size)
        if snapshot:
            message += f"; allocator history in {dump_memory_snapshot(run_dir, 'out of memory')}"
        raise RunFailed(message) from None
    except CheckpointWriteError as e:
        raise RunFailed(str(e)) from None


def _raise_unless_completed(summary: RunSummary, hint: str) -> None:
    """A diverged run fails; a stopped one is interrupted, with the command that continues it."""
    if summary["failure"]:
        raise RunFailed(summary["failure"])
    signum = summary["interrupted_by"]
    if signum is not None:
        where = summary["checkpoints"][-1] if summary["checkpoints"] else "no checkpoint (no run dir)"
        summary["status"] = "interrupted"
        summary["reason"] = f"{signal.Signals(signum).name} at step {summary['steps']}; saved {where}"
        raise Interrupted(signum, f"stopped by {summary['reason']}; continue with: {hint}")


def _continue_hint(summary: RunSummary, run_dir: Path | None) -> str:
    """``perfrun train`` with this job's overrides, its run dir and resume=auto: pasted as is,
    it continues this run whatever else the outputs folder holds."""
    kept = [o for o in summary.get("overrides", []) if not o.lstrip("+~").startswith("resume=")]
    if run_dir is not None:
        kept.append(f"hydra.run.dir={run_dir}")
    return " ".join(["perfrun", "train", *map(shlex.quote, kept), "resume=auto"])


def _oom_message(cfg: TrainConfig, device: torch.device, batch_size: int | None) -> str:
    used = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    return (
        f"out of memory on {device} (peak {used:.1f} of {total:.1f} GiB) with model={cfg.model.name} "
        f"dataloader.batch_size={batch_size or cfg.dataloader.batch_size} seq_len={cfg.data.seq_len or cfg.model.block_size}; "
        "try a smaller dataloader.batch_size with accumulation.steps to keep the global batch, "
        "checkpointing=full, or precision=bf16"
    )


def _release(device: torch.device | None) -> None:
    """Give back what this job took, so the next job of a sweep starts clean. With
    ``runtime.gc=freeze`` the heap is still frozen here, and the collection walks only what
    the job made (:mod:`perfrun.loop.runtime`)."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _log_summary(summary: RunSummary) -> None:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    mfu = summary.get("mfu_median")
    log.info(
        f"done: {f(summary.get('tokens_per_s_median'), ',.0f')} tok/s (median of {summary.get('steady_steps')} steady steps), "
        + (f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a (no peak: see the MFU peak line above)")
        + f", peak mem {f(summary.get('peak_mem_mib'), ',.0f')} MiB, {data_figure(summary)}, "
        f"first step {f(summary.get('first_step_s'), '.2f')} s, train loss {f(summary.get('final_train_loss'), '.4f')}, "
        f"val loss {f(summary.get('final_val_loss'), '.4f')}"
    )
