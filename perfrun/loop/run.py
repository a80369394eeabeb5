"""One training job: setup, the parts of the loop, and the loop itself, read as a schedule.

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
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from perfrun import distributed
from perfrun.checkpoint.atomic import write_json
from perfrun.checkpoint.checkpointer import Checkpointer, Parts, Start, checkpoint_folder
from perfrun.checkpoint.files import CheckpointWriteError, check_writable
from perfrun.checkpoint.resume_search import RunSearch, job_config
from perfrun.checkpoint.run_lock import RunRecord, locked
from perfrun.config import ConfigError, validate
from perfrun.console import first_line
from perfrun.data import build_datasets, build_loader
from perfrun.device_conditions import device_kind, rung_applies
from perfrun.environment import device_name, environment, global_state, rank_info
from perfrun.knobs import Plan, apply_knobs, fp8, fsdp
from perfrun.loop.evaluation import Evaluator
from perfrun.loop.optimizer import build_optimizer, build_scheduler
from perfrun.loop.step import BatchStream, TrainStep
from perfrun.loop.stopping import Diverged, GracefulStop, Interrupted, NonFiniteGuard
from perfrun.models.gpt import GPT, GPTConfig, padded_vocab
from perfrun.models.pretrained import init_from
from perfrun.summary import RunSummary
from perfrun.telemetry import contention
from perfrun.telemetry.loggers import build_sinks
from perfrun.telemetry.mfu import mfu_dtype, resolve_peak
from perfrun.telemetry.profiling import attach_profiler, dump_memory_snapshot, start_memory_history
from perfrun.telemetry.sinks import ConsoleReporter, RecordSink, data_figure
from perfrun.telemetry.step_metrics import MetricsConfig, StepMetrics, Throughput

log = logging.getLogger("perfrun")


class RunFailed(RuntimeError):
    """A run that stopped for a reason the user can act on (out of memory, ...)."""


@dataclass
class Setup:
    """What setup built: the device, the plan the knobs made, the optimizer and the data."""

    device: torch.device
    plan: Plan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    throughput: Throughput
    facts: RunSummary  # the model, data, knobs and MFU peak, for summary.json


def setup(cfg: Any, stack: ExitStack) -> Setup:
    """Everything before the first step: validated config, data, model, knobs, optimizer."""
    validate(cfg)
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed} is outside what the random number generators take (0 to 2**32-1, numpy's "
                          "limit); choose a seed in that range")
    fsdp.check(cfg)
    device = distributed.setup_device(cfg.device, cfg.distributed, stack)
    fp8.check(cfg, device)  # refused before any data or model is built
    rank, world = distributed.rank(), distributed.world_size()
    snapshot = start_memory_history(cfg, device, stack)
    distributed.seed_everything(cfg.seed)
    seq_len = cfg.data.seq_len or cfg.model.block_size
    data = build_datasets(cfg.data, seq_len, cfg.seed)
    cfg.data.tokenizer, cfg.data.vocab_size = data.tokenizer, data.vocab_size  # what the ids are, recorded with the run
    log.info(data.description)

    m = cfg.model
    gpt_config = GPTConfig(
        vocab_size=padded_vocab(data.vocab_size), block_size=m.block_size, n_layer=m.n_layer,
        n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, attention=cfg.attention,
    )
    model = init_from(GPT(gpt_config), m, data.vocab_size).to(device)
    plan = apply_knobs(cfg, device, model, stack)
    optimizer, fused = build_optimizer(model, cfg.optim, device)
    if world > 1:
        distributed.seed_rank(cfg.seed, rank)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    auto_batch = None
    if cfg.dataloader.batch_size == "auto":  # the largest batch that fits, found before the loaders exist
        from perfrun.loop.auto_batch import resolve_auto_batch

        auto_batch = resolve_auto_batch(cfg, device, plan, optimizer, len(data.train), seq_len, data.vocab_size)
        cfg.dataloader.batch_size = auto_batch["batch_size"]

    train_loader = build_loader(data.train, cfg.dataloader, device_type=device.type, shuffle=True, seed=cfg.seed,
                                rank=rank, world=world)
    val_loader = build_loader(data.val, cfg.dataloader, device_type=device.type, shuffle=False, seed=cfg.seed,
                              rank=rank, world=world)

    peak = resolve_peak(str(cfg.mfu.peak), device, mfu_dtype(cfg.precision.dtype, device, cfg.precision.tf32))
    tokens_per_step = cfg.dataloader.batch_size * seq_len * plan.micro_steps * world  # all ranks together
    throughput = Throughput(tokens_per_step, model.flops_per_token(seq_len), peak.tflops, peak.source, world)
    facts: RunSummary = {
        "knobs": plan.notes, "fused_adamw": fused,
        "params": model.num_params(non_embedding=False), "params_non_embedding": model.num_params(),
        "vocab_size": data.vocab_size, "vocab_size_padded": gpt_config.vocab_size, "seq_len": seq_len,
        "tokens_per_step": tokens_per_step, "flops_per_token": throughput.flops_per_token, **peak.facts(),
        "data": data.description, "batch_size_auto": auto_batch, "memory_snapshot": snapshot,
    }
    log.info(
        f"model {m.name}: {facts['params'] / 1e6:.2f}M parameters, seq_len {seq_len}, "
        f"{tokens_per_step:,} tokens/step, device {device} ({device_name(device)})"
        + (f", {world} ranks ({cfg.distributed.upper()}, {cfg.dataloader.batch_size * world} sequences per micro-step in all)"
           if world > 1 else "")
    )
    log.info(peak.describe())
    return Setup(device, plan, optimizer, scheduler, train_loader, val_loader, throughput, facts)


@dataclass
class Loop:
    """The parts the loop calls, each deciding its own cadence."""

    max_steps: int
    train_step: TrainStep
    metrics: StepMetrics
    guard: NonFiniteGuard
    evaluator: Evaluator
    checkpointer: Checkpointer
    stop: GracefulStop


def build_loop(cfg: Any, built: Setup, run_dir: Path | None, sink: RecordSink, reporter: ConsoleReporter,
               stop: GracefulStop, search: RunSearch | None = None) -> Loop:
    """The loop's parts, from the config and what setup built; nothing starts yet."""
    plan, device, optimizer, scheduler = built.plan, built.device, built.optimizer, built.scheduler
    when = MetricsConfig(cfg.log_every, cfg.max_steps, cfg.monitor.every_n_steps, cfg.timing_warmup_steps)
    # on CUDA: batches copied ahead, or drawn on the device
    stream = BatchStream(built.train_loader, device, ahead=device.type == "cuda" and cfg.dataloader.device_input)
    plan.notes["input"] = stream.input_path
    metrics = StepMetrics(device, built.throughput, when, sink, reporter, lr=lambda: scheduler.get_last_lr()[0],
                          loss_scale=plan.loss_scale, compiled=bool(cfg.compile),
                          gpu_waits=stream.pop_gpu_wait_ms, handoffs_per_step=plan.micro_steps)
    guard = NonFiniteGuard(device, cfg.guard.max_bad_steps, scaler_skips=plan.skips_nonfinite_steps)
    checkpointer = Checkpointer(cfg.checkpoint, checkpoint_folder(cfg.checkpoint.dir, run_dir),
                                Parts(plan, optimizer, scheduler, stream, metrics), guard, sink,
                                config=_plain(cfg), seed=cfg.seed, max_steps=cfg.max_steps, search=search)
    return Loop(
        max_steps=cfg.max_steps,
        train_step=TrainStep(plan, optimizer, scheduler, stream, metrics, clip=cfg.optim.grad_clip, device=device),
        metrics=metrics, guard=guard, checkpointer=checkpointer, stop=stop,
        evaluator=Evaluator(plan, built.val_loader, device, every=cfg.eval_every, batches=cfg.eval_batches,
                            max_steps=cfg.max_steps),
    )


def train_loop(loop: Loop, start: Start) -> RunSummary:
    """Run optimizer steps start.step+1 .. max_steps; return the figures for summary.json.

    Ends early, with the figures so far, on a signal (``interrupted_by``) or when the
    guard sees the run diverge (``failure``).
    """
    train_step, metrics, guard, evaluator = loop.train_step, loop.metrics, loop.guard, loop.evaluator
    checkpointer, stop = loop.checkpointer, loop.stop
    train_step.start(start.epoch, start.consumed)
    metrics.start(start.step, start.tokens)
    step, interrupted_by, failure = start.step, None, None
    try:
        for step in range(start.step + 1, loop.max_steps + 1):
            loss, grad_norm, data_wait = train_step(step)
            guard.record(step, loss, grad_norm)
            metrics.record_step(step, loss, grad_norm, data_wait)
            stopping = stop.agreed()  # every rank stops at the same step
            if metrics.should_log(step) or stopping:
                guard.flush()
                metrics.log(step)
            if metrics.should_sample(step):
                metrics.sample(step)
            if stopping:
                interrupted_by = stop.stop_signal()
                checkpointer.save(step)
                break
            checkpointer.maybe_save(step)
            if evaluator.should_run(step):
                with metrics.paused():
                    metrics.log_eval(step, evaluator.run())
        guard.flush()
        if interrupted_by is None:
            checkpointer.save_at_end(step)
    except Diverged as e:
        failure = checkpointer.with_last_good(str(e))

    result = metrics.summary(step)
    result.update(evaluator.summary())
    result.update(checkpointer.summary())
    result.update(data_position=train_step.stream.position(), guard=guard.summary(),
                  interrupted_by=interrupted_by, failure=failure)
    return result


def run(cfg: Any, run_dir: Path | None, *, overrides: list[str] | None = None,
        search_root: Path | None = None) -> RunSummary:
    """One training job. Writes metrics.jsonl and summary.json into ``run_dir`` (rank 0).

    Raises ConfigError or RunFailed (after writing a ``failed`` summary) for what the user
    can fix, and for anything unexpected (its traceback goes to train.log); Interrupted
    (after an ``interrupted`` summary and a checkpoint) on SIGINT/SIGTERM; the caller turns
    them into one line and an exit code. A job refused before its first step writes no
    summary over one already in ``run_dir``; ``search_root``: where ``resume=auto`` looks
    for the run to continue when ``run_dir`` holds no checkpoint.
    """
    rank, world = rank_info()
    main = rank == 0
    try:
        applies = rung_applies(cfg.ablation.acts_on, cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not applies:
        return _skip_rung(cfg, run_dir if main else None, overrides)
    t_start = time.perf_counter()
    state_at_start = global_state()
    summary: RunSummary = {"status": "running", "overrides": list(overrides or []), "rank": rank, "world_size": world}
    record = RunRecord(run_dir if main else None)
    search = RunSearch(search_root, job_config(cfg), run_dir) if search_root is not None else None
    sink: RecordSink | None = None
    device: torch.device | None = None
    try:
        with ExitStack() as stack, GracefulStop() as stop:
            _hold_folders(cfg, run_dir, stack)
            record.owned = True
            sink = build_sinks(cfg, run_dir, rank)  # metrics.jsonl and the experiment logger, on rank 0
            built = setup(cfg, stack)
            device = built.device
            summary.update(built.facts)
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
                summary.update(_train(cfg, loop, start, run_dir, snapshot=bool(built.facts["memory_snapshot"] and main)))
            # did this job have the machine to itself? (the monitor's figures, else the host's at log points)
            summary["contention"] = contention.assess(summary.get("monitor") or summary.get("host_load") or {})
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
        _release(device)
        summary["global_state_at_start"] = state_at_start
        summary["global_state_after"] = global_state()
        summary["wall_s"] = time.perf_counter() - t_start
        if cfg is not None:
            summary["config"] = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
        unwritten = _write_summary(summary, record, run_dir) if main and run_dir is not None else None
        if sink is not None:
            sink.close(summary)  # the loggers end their runs with it
        if summary["status"] == "completed":
            _log_summary(summary)
        if unwritten is not None and summary["status"] == "completed":
            raise RunFailed(unwritten)


def _skip_rung(cfg: Any, run_dir: Path | None, overrides: list[str] | None) -> RunSummary:
    """A ladder rung whose knob cannot act on this device (TF32 on a CPU, FP8 without FP8
    tensor cores) is not run: measured, it would be the rung below plus noise. Its summary
    says why, so the report shows it as not applicable; a summary already in ``run_dir`` stays."""
    reason = f"not applicable on {device_kind(cfg.device)}: {cfg.ablation.why}"
    summary: RunSummary = {"status": "skipped", "reason": reason, "overrides": list(overrides or []),
                           "config": OmegaConf.to_container(cfg, resolve=True)}
    log.info(f"rung {cfg.ablation.rung} skipped, {reason}")
    if run_dir is not None and not (run_dir / "summary.json").exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "summary.json", summary)
    return summary


def _hold_folders(cfg: Any, run_dir: Path | None, stack: ExitStack) -> None:
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


def _train(cfg: Any, loop: Loop, start: Start, run_dir: Path | None, *, snapshot: bool) -> RunSummary:
    """The loop, with out of memory and a failed save turned into a RunFailed with the fix
    (and, with ``snapshot``, the allocator history written beside it)."""
    try:
        return train_loop(loop, start)
    except torch.OutOfMemoryError:
        message = _oom_message(cfg, loop.train_step.device)
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


def _plain(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain containers: what a checkpoint records and compares."""
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)


def _oom_message(cfg: Any, device: torch.device) -> str:
    used = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    return (
        f"out of memory on {device} (peak {used:.1f} of {total:.1f} GiB) with model={cfg.model.name} "
        f"dataloader.batch_size={cfg.dataloader.batch_size} seq_len={cfg.data.seq_len or cfg.model.block_size}; "
        "try a smaller dataloader.batch_size with accumulation.steps to keep the global batch, "
        "checkpointing=full, or precision=bf16"
    )


def _release(device: torch.device | None) -> None:
    """Give back what this job took, so the next job of a sweep starts clean."""
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
