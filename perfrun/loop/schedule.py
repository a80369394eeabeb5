"""The loop as a schedule: its parts (the train step, step metrics, the NaN guard, the
evaluator, the checkpointer) built from the config, then called in order; each part decides
its own cadence, and the loop names no knob: what a knob changes, the plan carries."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from perfrun.checkpoint.checkpointer import Checkpointer, Start, checkpoint_folder
from perfrun.checkpoint.resume_search import RunSearch
from perfrun.config import TrainConfig
from perfrun.loop.budget import TimeBudget
from perfrun.loop.evaluation import Evaluator
from perfrun.loop.setup import Setup
from perfrun.loop.step import BatchStream, TrainStep
from perfrun.loop.stopping import Diverged, GracefulStop, NonFiniteGuard
from perfrun.memory.breakdown import TrackedStep
from perfrun.summary import RunSummary
from perfrun.telemetry.sinks import ConsoleReporter, RecordSink
from perfrun.telemetry.step_metrics import MetricsConfig, StepMetrics

log = logging.getLogger("perfrun")

@dataclass
class Loop:
    """The parts the loop calls, each deciding its own cadence."""

    max_steps: int
    train_step: TrainStep | TrackedStep
    metrics: StepMetrics
    guard: NonFiniteGuard
    evaluator: Evaluator
    checkpointer: Checkpointer
    stop: GracefulStop
    budget: TimeBudget


def build_loop(cfg: TrainConfig, built: Setup, run_dir: Path | None, sink: RecordSink, reporter: ConsoleReporter,
               stop: GracefulStop, search: RunSearch | None = None) -> Loop:
    """The loop's parts, from the config and what setup built; nothing starts yet."""
    plan, device, optimizer, scheduler = built.plan, built.device, built.optimizer, built.scheduler
    when = MetricsConfig(cfg.log_every, cfg.max_steps, cfg.monitor.every_n_steps, cfg.timing_warmup_steps)
    # on CUDA: batches copied ahead, or drawn on the device
    stream = BatchStream(built.train_loader, device, ahead=device.type == "cuda" and cfg.dataloader.device_input)
    plan.notes["input"] = stream.input_path
    metrics = StepMetrics(device, built.throughput, when, sink, reporter, lr=lambda: float(scheduler.get_last_lr()[0]),
                          loss_scale=plan.loss_scale, compiled=bool(cfg.compile),
                          gpu_waits=stream.pop_gpu_wait_ms, handoffs_per_step=plan.micro_steps)
    guard = NonFiniteGuard(device, cfg.guard.max_bad_steps, scaler_skips=plan.skips_nonfinite_steps)
    parts = {"model": plan.raw_model, "optimizer": optimizer, "scheduler": scheduler, "scaler": plan, "data": stream,
             "tokens": metrics}  # each saved under its name
    checkpointer = Checkpointer(cfg.checkpoint, checkpoint_folder(cfg.checkpoint.dir, run_dir), parts, sink.write,
                                sharded=plan.sharded_state, all_finite=guard.all_finite, paused=metrics.paused,
                                config=built.resolved.config_record(cfg), seed=cfg.seed, max_steps=cfg.max_steps, search=search)
    train_step: TrainStep | TrackedStep = TrainStep(plan, optimizer, scheduler, stream, metrics,
                                                    clip=cfg.optim.grad_clip, device=device)
    if cfg.memory.breakdown:  # one step after the warm-up runs under the memory tracker
        train_step = TrackedStep(train_step, metrics, sink, warmup=cfg.timing_warmup_steps, max_steps=cfg.max_steps)
    return Loop(
        max_steps=cfg.max_steps,
        train_step=train_step,
        metrics=metrics, guard=guard, checkpointer=checkpointer, stop=stop,
        budget=TimeBudget(cfg.ablation.budget_s, cfg.timing_warmup_steps, cfg.max_steps),
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
    train_step.start()
    metrics.start(start.step)
    loop.budget.start(start.step)
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
            if loop.budget.spent(step):
                break
        guard.flush()
        if interrupted_by is None:
            checkpointer.save_at_end(step)
    except Diverged as e:
        failure = checkpointer.with_last_good(str(e))

    result = metrics.summary(step)
    result.update(evaluator.summary())
    result.update(checkpointer.summary())
    result.update(loop.budget.summary())
    result.update(data_position=train_step.stream.position(), guard=guard.summary(),
                  interrupted_by=interrupted_by, failure=failure)
    return result

