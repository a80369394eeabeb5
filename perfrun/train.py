"""Setup and the training loop. The loop is knob-agnostic: it calls what the plan hands it.

Data flow: cfg -> setup (device, seed, data, model, knobs, optimizer, loaders) -> loop
(timed wait for the batch, micro-steps under the plan's contexts, unscale/clip/step) ->
records to the sinks -> summary.json.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from omegaconf import OmegaConf

from perfrun import checkpoint, distributed
from perfrun.atomic import write_json
from perfrun.checkpoint import capture_rng, restore_rng
from perfrun.config import ConfigError, validate
from perfrun.data import build_datasets, build_loader
from perfrun.devices import resolve_device
from perfrun.environment import device_name, environment, global_state, rank_info
from perfrun.guards import Diverged, GracefulStop, Interrupted, NonFiniteGuard
from perfrun.knobs import Plan, apply_knobs
from perfrun.model import GPT, GPTConfig, padded_vocab
from perfrun.optim import build_optimizer, build_scheduler
from perfrun.telemetry import contention
from perfrun.telemetry.profiling import attach_profiler, dump_memory_snapshot, start_memory_history
from perfrun.telemetry.sinks import ConsoleReporter, JsonlSink
from perfrun.telemetry.throughput import PhaseTimer, StepTimer, Throughput, median

log = logging.getLogger("perfrun")


class RunFailed(RuntimeError):
    """A run that stopped for a reason the user can act on (out of memory, ...)."""


def _rank_device(cfg: Any, device: torch.device) -> torch.device:
    """Under DDP or FSDP each process of a machine owns the GPU of its LOCAL_RANK; a world
    of one that torchrun did not start keeps the device it was given (cuda:N)."""
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ:
        return device
    index = distributed.local_rank()
    if cfg.device not in ("auto", "cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"device={cfg.device} with distributed={cfg.distributed}: each rank takes cuda:LOCAL_RANK; "
                          "set device=auto or device=cuda")
    if index >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={index} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                          "start at most that many processes per node")
    return torch.device("cuda", index)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int) -> None:
    """Ranks share the model's initial weights (one seed) but not their dropout masks:
    after the model is built, rank r draws from ``seed + r``."""
    torch.manual_seed(seed + rank)


def resolve_peak(cfg: Any, device: torch.device, dtype_name: str) -> tuple[float | None, str, dict[str, Any]]:
    """MFU's denominator: datasheet table, gpu-check's measurement, or the user's number.

    Returns (peak TFLOPS or None, where it came from, both figures for the summary).
    """
    from perfrun.telemetry.peaks import datasheet_peak_tflops, measured_peak_tflops

    name = device_name(device)
    sheet, sheet_note = datasheet_peak_tflops(name, dtype_name)
    figures: dict[str, Any] = {"datasheet_tflops": sheet, "datasheet_note": sheet_note}
    choice = str(cfg.mfu.peak)
    if choice == "datasheet":
        return sheet, (f"datasheet {dtype_name} peak for {name}" if sheet else sheet_note), figures
    if choice == "measured":
        measured, how = measured_peak_tflops(device, dtype_name)
        figures["measured_tflops"] = measured
        return measured, f"measured {dtype_name} matmul peak ({how})", figures
    return float(choice), "mfu.peak given by the user", figures


def mfu_dtype(cfg: Any, device: torch.device) -> str:
    dtype = cfg.precision.dtype
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "fp16"
    return "tf32" if (device.type == "cuda" and cfg.precision.tf32) else "fp32"


class BatchStream:
    """Endless batches from a resumable position: (epoch, samples consumed in it).

    The position counts what the loop took, not what workers prefetched, so a checkpoint
    taken between steps resumes on exactly the next batch. Under DDP it counts the samples
    of all ranks (each takes one batch per call), the unit the sharded sampler starts from.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, epoch: int = 0, consumed: int = 0) -> None:
        self.loader = loader
        self.batch_size = int(loader.batch_size) * getattr(loader.sampler, "world", 1)
        self.epoch, self.consumed = epoch, consumed
        loader.sampler.set_position(epoch, consumed)
        self._it = iter(loader)

    def next(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.consumed = self.epoch + 1, 0
            self.loader.sampler.set_position(self.epoch, 0)
            self._it = iter(self.loader)
            batch = next(self._it)
        self.consumed += self.batch_size
        return batch

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}


class MemoryTracker:
    """Peak memory: the CUDA allocator's peak on GPU, sampled process RSS on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.source = "cuda_max_memory_allocated" if self.cuda else "process_rss_sampled_at_log_steps"
        self._proc = psutil.Process()
        self._peak = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def peak_mib(self) -> float:
        if self.cuda:
            self._peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._peak = max(self._peak, self._proc.memory_info().rss)
        return self._peak / 2**20


@dataclass
class Setup:
    device: torch.device
    plan: Plan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    throughput: Throughput
    seq_len: int
    notes: dict[str, Any]


def setup(cfg: Any, stack: ExitStack) -> Setup:
    """Everything before the first step: validated config, data, model, knobs, optimizer."""
    validate(cfg)
    device = resolve_device(cfg.device)
    if cfg.distributed != "none":
        device = _rank_device(cfg, device)
        if distributed.ensure_group(device):
            stack.callback(distributed.destroy)
    rank, world = distributed.rank(), distributed.world_size()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.empty_cache()
    snapshot = start_memory_history(cfg, device, stack)
    seed_everything(cfg.seed)
    seq_len = cfg.data.seq_len or cfg.model.block_size
    data = build_datasets(cfg.data, seq_len, cfg.seed)
    log.info(data.description)

    m = cfg.model
    gcfg = GPTConfig(
        vocab_size=padded_vocab(data.vocab_size), block_size=m.block_size, n_layer=m.n_layer,
        n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, attention=cfg.attention,
    )
    model = GPT(gcfg).to(device)
    plan = apply_knobs(cfg, device, model, stack)
    optimizer, fused = build_optimizer(model, cfg.optim, device)
    if world > 1:
        seed_rank(cfg.seed, rank)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    auto_batch = None
    if cfg.dataloader.batch_size == "auto":  # the largest batch that fits, found before the loaders exist
        from perfrun.batch_size import resolve_auto_batch

        auto_batch = resolve_auto_batch(cfg, device, plan, optimizer, len(data.train), seq_len, data.vocab_size)
        cfg.dataloader.batch_size = auto_batch["batch_size"]

    train_loader = build_loader(data.train, cfg.dataloader, device_type=device.type, shuffle=True, seed=cfg.seed,
                                rank=rank, world=world)
    val_loader = build_loader(data.val, cfg.dataloader, device_type=device.type, shuffle=False, seed=cfg.seed,
                              rank=rank, world=world)

    dtype_name = mfu_dtype(cfg, device)
    peak, peak_source, peak_figures = resolve_peak(cfg, device, dtype_name)
    tokens_per_step = cfg.dataloader.batch_size * seq_len * plan.micro_steps * world  # all ranks together
    throughput = Throughput(tokens_per_step, model.flops_per_token(seq_len), peak, peak_source, world)
    notes = {
        "knobs": plan.notes,
        "fused_adamw": fused,
        "params": model.num_params(non_embedding=False),
        "params_non_embedding": model.num_params(),
        "vocab_size": data.vocab_size,
        "vocab_size_padded": gcfg.vocab_size,
        "seq_len": seq_len,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": throughput.flops_per_token,
        "mfu_peak_tflops": peak,
        "mfu_peak_source": peak_source,
        "mfu_dtype": dtype_name,
        **peak_figures,
        "data": data.description,
        "batch_size_auto": auto_batch,
        "memory_snapshot": snapshot,
    }
    log.info(
        f"model {m.name}: {notes['params'] / 1e6:.2f}M parameters, seq_len {seq_len}, "
        f"{tokens_per_step:,} tokens/step, device {device} ({device_name(device)})"
        + (f", {world} ranks ({cfg.distributed.upper()}, {cfg.dataloader.batch_size * world} sequences per micro-step in all)"
           if world > 1 else "")
    )
    sheet = peak_figures.get("datasheet_tflops")
    log.info(
        f"MFU peak: {f'{peak:,.1f} TFLOPS {dtype_name}' if peak else 'none'} ({peak_source})"
        + (f"; datasheet {sheet:,.1f} TFLOPS" if sheet and sheet != peak else "")
    )
    return Setup(device, plan, optimizer, scheduler, train_loader, val_loader, throughput, seq_len, notes)


@torch.no_grad()
def evaluate(s: Setup, batches: int) -> float | None:
    """Mean validation loss over the first ``batches`` batches of the (unshuffled) val set.

    Runs the uncompiled model: switching a compiled one to eval mode would recompile it
    (dynamo guards on ``training``), and that time has nothing to do with training speed.
    """
    model = s.plan.raw_model
    model.eval()
    losses = []
    for i, (x, y) in enumerate(s.val_loader):
        if i >= batches:
            break
        x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
        with s.plan.forward_context():
            _, loss = model(x, y)
        losses.append(loss.float())
    model.train()
    if not losses:
        log.warning("validation set holds less than one batch: no val loss (lower dataloader.batch_size or raise data.val_fraction)")
        return None
    return distributed.mean_over_ranks(torch.stack(losses).mean()).item()  # each rank saw its shard


def _oom_message(cfg: Any, device: torch.device) -> str:
    used = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    return (
        f"out of memory on {device} (peak {used:.1f} of {total:.1f} GiB) with model={cfg.model.name} "
        f"dataloader.batch_size={cfg.dataloader.batch_size} seq_len={cfg.data.seq_len or cfg.model.block_size}; "
        "try a smaller dataloader.batch_size with accumulation.steps to keep the global batch, "
        "checkpointing=full, or precision=bf16"
    )


@dataclass
class Start:
    """Where the loop starts: step 0 for a fresh run, the checkpoint's step on resume."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0
    tokens: int = 0
    checkpoint: str | None = None


def restore(s: Setup, ckpt: dict[str, Any], path: Path, seed: int) -> Start:
    """Load a checkpoint's state into the freshly built model, optimizer and schedule.

    On as many ranks as it was saved from, every rank gets its own random state back and
    the run continues bit for bit. On another number of ranks (a sharded checkpoint
    reshards; a single file loads anywhere) the weights, optimizer, schedule and data
    position carry over (the global batch is checked to be the same), but the random
    streams are reseeded.
    """
    if ckpt.get("sharded_path"):
        checkpoint.load_sharded_into(Path(ckpt["sharded_path"]), s.plan.raw_model, s.optimizer)
    elif s.plan.sharded_state:
        raise ConfigError(f"resume={path} is a single-file checkpoint (distributed=none or ddp) and distributed=fsdp "
                          "reads sharded ones; resume it with distributed=ddp (any number of ranks), or start fresh")
    else:
        s.plan.raw_model.load_state_dict(ckpt["model"])
        s.optimizer.load_state_dict(ckpt["optimizer"])
    s.scheduler.load_state_dict(ckpt["scheduler"])
    if s.plan.scaler is not None and ckpt.get("scaler"):
        s.plan.scaler.load_state_dict(ckpt["scaler"])
    data = ckpt["data"]
    rank, world, saved_world = distributed.rank(), distributed.world_size(), checkpoint.saved_world(ckpt)
    if saved_world == world:
        ranks = ckpt.get("rng_ranks")
        restore_rng(ranks[rank] if ranks else ckpt["rng"])
    else:
        restore_rng(ckpt["rng"])
        seed_rank(seed + int(ckpt["step"]), rank)
        log.warning(f"resume={path} was saved by {saved_world} rank(s) and continues on {world}, with the same "
                    f"global batch and data order (from sample {data['consumed']} of epoch {data['epoch']}); the random "
                    "streams (dropout) are reseeded per rank and sums run in another order, so not bit for bit")
    return Start(step=int(ckpt["step"]), epoch=int(data["epoch"]), consumed=int(data["consumed"]),
                 tokens=int(ckpt.get("tokens", 0)))


def _resolve_resume(spec: str, ckpt_dir: Path | None) -> Path | None:
    """Rank 0 picks the checkpoint (``auto``: the newest) and every rank takes that one,
    so ranks never resume from different steps."""
    found, error = None, None
    if distributed.rank() == 0:
        try:
            if spec == "auto" and ckpt_dir is not None:
                checkpoint.recover_interrupted_saves(ckpt_dir)  # a sharded save cut between its renames
            found = checkpoint.resolve(spec, ckpt_dir)
        except ConfigError as e:
            error = str(e)
    found, error = distributed.from_rank0((found, error))
    if error is not None:
        raise ConfigError(error)
    return found


def _load_on_every_rank(path: Path) -> dict[str, Any]:
    """Each rank reads the checkpoint; if one cannot (a folder not shared between nodes),
    all stop with the reason instead of waiting for each other."""
    ckpt, problem = None, None
    try:
        ckpt = checkpoint.load(path)
    except ConfigError as e:
        problem = str(e)
    if distributed.any_rank(problem is not None):
        raise ConfigError(problem or f"resume={path}: another rank cannot read this checkpoint; put checkpoints "
                          "on a filesystem that every node sees (checkpoint.dir=/shared/...)")
    return ckpt


def model_shape(s: Setup) -> dict[str, int]:
    c = s.plan.raw_model.config
    return {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "block_size": c.block_size,
            "vocab_size": c.vocab_size}


def train_loop(cfg: Any, s: Setup, sink: JsonlSink, reporter: ConsoleReporter, monitor: Any,
               start: Start, ckpt_dir: Path | None, stop: GracefulStop) -> dict[str, Any]:
    """Run optimizer steps start.step+1 .. max_steps; return the figures for summary.json.

    Ends early, with the figures so far, on a signal (``interrupted_by``) or when the
    guard sees the run diverge (``failure``).
    """
    plan, device = s.plan, s.device
    model, opt, sched, scaler = plan.model, s.optimizer, s.scheduler, plan.scaler
    params = [p for p in plan.raw_model.parameters() if p.requires_grad]
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    micro = plan.micro_steps
    stream = BatchStream(s.train_loader, start.epoch, start.consumed)
    timer = StepTimer(device)
    phases = PhaseTimer(device)
    memory = MemoryTracker(device)
    guard = NonFiniteGuard(device, cfg.guard.max_bad_steps, scaler_skips=scaler is not None)
    tp = s.throughput
    warm = cfg.timing_warmup_steps

    host_wall: list[float] = []  # per step of this process, index = step - start.step - 1
    data_wait: list[float] = []
    loss_sum = torch.zeros((), device=device)
    i0 = 0  # local index where the current log interval starts
    total_time, total_tokens = 0.0, start.tokens
    last_train_loss: float | None = None
    last_val: float | None = None
    first_step_s: float | None = None
    eval_time = ckpt_time = 0.0
    saved: list[str] = []
    interrupted_by: int | None = None
    failure: str | None = None

    def save_checkpoint(step: int) -> None:
        nonlocal ckpt_time
        if ckpt_dir is None:
            return
        guard.flush()
        if distributed.any_rank(bool(guard.streak)):
            log.warning(f"step {step}: not saving a checkpoint of a non-finite state; the last good one stays")
            return
        timer.flush()
        t = time.perf_counter()
        rng = capture_rng()
        rng_ranks = distributed.gather_to_rank0(rng)  # each rank draws its own dropout masks
        state = {
            "scheduler": sched.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng, "rng_ranks": rng_ranks if distributed.world_size() > 1 else None,
            "world_size": distributed.world_size(),
            "data": stream.position(), "tokens": start.tokens + len(host_wall) * tp.tokens_per_step,
            "model_shape": model_shape(s),
            "config": OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg),
        }
        if plan.sharded_state:  # every rank writes its shards
            path = checkpoint.save_sharded(ckpt_dir, step, plan.raw_model, opt, state, cfg.checkpoint.keep_last)
        else:
            path, error = None, None
            if distributed.rank() == 0:  # one writer; every rank holds the same weights
                state.update(model=plan.raw_model.state_dict(), optimizer=opt.state_dict())
                try:
                    path = checkpoint.save(ckpt_dir, step, state, cfg.checkpoint.keep_last)
                except checkpoint.CheckpointWriteError as e:
                    error = str(e)
            path, error = distributed.from_rank0((path, error))  # a barrier: no rank runs ahead of the file
            if error is not None:
                raise checkpoint.CheckpointWriteError(error)
        saved.append(str(path))
        ckpt_time += time.perf_counter() - t
        sink.write({"kind": "checkpoint", "step": step, "path": str(path), "save_s": time.perf_counter() - t})
        timer.start()  # saving stays out of the step times

    model.train()
    t_loop = time.perf_counter()
    timer.start()
    step = start.step
    try:
        for step in range(start.step + 1, cfg.max_steps + 1):
            t0 = time.perf_counter()
            wait = 0.0
            phases.begin()
            step_loss = torch.zeros((), device=device)
            for i in range(micro):
                tw = time.perf_counter()
                x, y = stream.next()
                wait += time.perf_counter() - tw
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                phases.mark("data")
                with plan.micro_step_context(i, micro):  # DDP: all-reduce on the last micro-step only
                    with plan.forward_context():
                        _, loss = model(x, y)
                        loss = loss / micro
                    phases.mark("forward")
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    phases.mark("backward")
                step_loss += loss.detach()
            if scaler is not None:
                scaler.unscale_(opt)
            grad_norm = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(params, clip))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            phases.mark("optimizer")
            phases.end()
            timer.step_end()
            for hook in plan.step_hooks:
                hook(step)
            loss_sum += step_loss
            guard.record(step, step_loss, grad_norm)
            host_wall.append(time.perf_counter() - t0)
            data_wait.append(wait)
            done = len(host_wall)
            if done == 1:
                timer.flush()
                first_step_s = time.perf_counter() - t_loop
            reporter.advance(step)
            stopping = distributed.any_rank(stop.requested)  # every rank stops at the same step

            if step % cfg.log_every == 0 or step == cfg.max_steps or stopping:
                timer.flush()
                phases.flush()
                guard.flush()
                n = done - i0
                interval_time = sum(timer.durations[i0:done])
                interval_tokens = n * tp.tokens_per_step
                total_time += interval_time
                total_tokens += interval_tokens
                tps = tp.tokens_per_s(interval_time, n)
                last_train_loss = distributed.mean_over_ranks(loss_sum).item() / n  # the global batch's loss
                wall = sum(host_wall[i0:done])
                record = {
                    "kind": "train", "step": step, "max_steps": cfg.max_steps, "loss": last_train_loss,
                    "lr": sched.get_last_lr()[0], "grad_norm": grad_norm.item(),
                    "step_time_ms": 1000 * interval_time / n, "tokens_per_s": tps, "mfu": tp.mfu(tps),
                    "data_wait_pct": 100 * sum(data_wait[i0:done]) / wall if wall > 0 else 0.0,
                    "peak_mem_mib": memory.peak_mib(), "interval_steps": n, "interval_tokens": interval_tokens,
                    "interval_s": interval_time, "tokens": total_tokens, "elapsed_s": time.perf_counter() - t_loop,
                }
                if scaler is not None:
                    record["loss_scale"] = scaler.get_scale()
                sink.write(record)
                reporter.train(record)
                loss_sum.zero_()
                i0 = done

            if monitor is not None and step % cfg.monitor.every_n_steps == 0:
                stats = monitor.collect(step, None)  # step times attached at the end: no sync here
                ranks = _every_rank(stats)  # every rank's GPU and host figures, in rank 0's log
                sink.write({"kind": "monitor", "step": step, **stats, **({"ranks": ranks} if ranks else {})})
                reporter.monitor(step, stats, ranks)

            if stopping:
                interrupted_by = stop.signum or int(signal.SIGTERM)  # another rank got the signal first
                save_checkpoint(step)
                break
            if cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0 and step != cfg.max_steps:
                save_checkpoint(step)
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
                timer.flush()
                te = time.perf_counter()
                last_val = evaluate(s, cfg.eval_batches)
                eval_time += time.perf_counter() - te
                sink.write({"kind": "eval", "step": step, "val_loss": last_val})
                if last_val is not None:
                    reporter.line(f"step {step}: val loss {last_val:.4f}")
                timer.start()  # eval time stays out of the step times
        guard.flush()
        if interrupted_by is None and cfg.checkpoint.at_end:
            save_checkpoint(step)
    except Diverged as e:
        failure = str(e) + (f"; the last good checkpoint is {saved[-1]}" if saved else "")

    timer.flush()
    if monitor is not None:
        monitor.attach_step_times(start.step + 1, timer.durations, warmup=warm)
    steady = timer.durations[warm:]
    steady_wall = host_wall[warm:]
    if not steady:
        log.warning(f"no steady-state steps: all {len(timer.durations)} steps ran within timing_warmup_steps={warm}, "
                    "so the summary has no tokens/s or MFU; raise max_steps or lower timing_warmup_steps")
    med = median(steady)
    tps_median = tp.tokens_per_step / med if med else None  # rank 0's step time; all ranks' tokens
    return {
        "steps": step,
        "start_step": start.step,
        "tokens": total_tokens,
        "train_time_s": total_time,
        "eval_time_s": eval_time,
        "checkpoint_time_s": ckpt_time,
        "first_step_s": first_step_s,
        "step_time_ms_median": 1000 * med if med else None,
        "steady_steps": len(steady),
        "tokens_per_s_median": tps_median,
        "tokens_per_s_mean": tp.tokens_per_s(sum(steady), len(steady)) if steady else None,
        "tokens_per_s_per_rank_median": tps_median / tp.world if tps_median else None,
        "world_size": tp.world,
        "mfu_median": tp.mfu(tps_median) if tps_median else None,
        "peak_mem_mib": memory.peak_mib(),
        "peak_mem_source": memory.source,
        "data_wait_pct": 100 * sum(data_wait[warm:]) / sum(steady_wall) if steady_wall and sum(steady_wall) > 0 else None,
        "compile_s_estimate": (first_step_s - med) if (cfg.compile and first_step_s and med) else None,
        "final_train_loss": last_train_loss,
        "final_val_loss": last_val,
        "step_breakdown": phases.summary(warm),
        "data_position": stream.position(),
        "checkpoints": saved,
        "guard": guard.summary(),
        "interrupted_by": interrupted_by,
        "failure": failure,
    }


def run(cfg: Any, run_dir: Path | None, *, overrides: list[str] | None = None) -> dict[str, Any]:
    """One training job. Writes metrics.jsonl and summary.json into ``run_dir`` (rank 0).

    Raises ConfigError or RunFailed (after writing a ``failed`` summary) for what the user
    can fix, and Interrupted (after an ``interrupted`` summary and a checkpoint) on
    SIGINT/SIGTERM; the caller turns them into one line and an exit code.
    """
    rank, world = rank_info()
    main = rank == 0
    t_start = time.perf_counter()
    state_at_start = global_state()
    summary: dict[str, Any] = {"status": "running", "overrides": list(overrides or []), "rank": rank, "world_size": world}
    sink = JsonlSink(run_dir / "metrics.jsonl" if (main and run_dir is not None) else None)
    monitor = None
    device: torch.device | None = None
    try:
        with ExitStack() as stack, GracefulStop() as stop:
            s = setup(cfg, stack)
            device = s.device
            summary.update(s.notes)
            summary["environment"] = environment(device)
            ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else (run_dir / "checkpoints" if run_dir else None)
            start = Start()
            if ckpt_dir is not None and main:
                checkpoint.check_writable(ckpt_dir)
            if stop.requested:  # Ctrl-C or SIGTERM during setup: nothing to save yet
                raise Interrupted(stop.signum, f"stopped by {signal.Signals(stop.signum).name} during setup, before step 1")
            if cfg.resume:
                path = _resolve_resume(str(cfg.resume), ckpt_dir)
                if path is None:
                    log.warning(f"resume=auto: no checkpoint in {ckpt_dir}; starting from step 0 "
                                "(to continue a run, start it with the same hydra.run.dir or checkpoint.dir)")
                else:
                    ckpt = _load_on_every_rank(path)
                    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
                    for warning in checkpoint.check_compatible(ckpt, model_shape(s), config, path,
                                                               distributed.world_size()):
                        log.warning(warning)
                    start = restore(s, ckpt, path, cfg.seed)
                    start.checkpoint = str(path)
                    del ckpt
                    log.info(f"resumed from {path} at step {start.step}")
                    if start.step >= cfg.max_steps:
                        raise ConfigError(f"resume={path} is at step {start.step}, already at max_steps={cfg.max_steps}; "
                                          f"raise max_steps to train further")
            summary["resumed_from"] = start.checkpoint
            attach_profiler(cfg, device, s.plan, stack, run_dir, record=main)  # rank 0 records
            summary["setup_s"] = time.perf_counter() - t_start
            if cfg.monitor.every_n_steps > 0:
                from perfrun.telemetry.monitor import Monitor

                monitor = Monitor(device, cfg.monitor)
                monitor.start()
            with ConsoleReporter(cfg.progress, cfg.max_steps, enabled=main) as reporter:
                try:
                    figures = train_loop(cfg, s, sink, reporter, monitor, start, ckpt_dir, stop)
                except torch.OutOfMemoryError:
                    message = _oom_message(cfg, device)
                    if s.notes["memory_snapshot"] and main:
                        message += f"; allocator history in {dump_memory_snapshot(run_dir, 'out of memory')}"
                    raise RunFailed(message) from None
                except checkpoint.CheckpointWriteError as e:
                    raise RunFailed(str(e)) from None
            summary.update(figures)
            if s.notes["memory_snapshot"] and main:
                summary["memory_snapshot_path"] = dump_memory_snapshot(run_dir, "end of the job")
            if monitor is not None:
                monitor.close()
                # this rank's energy over this rank's tokens; the job's is summed over ranks
                summary["monitor"] = monitor.summary((figures["tokens"] - start.tokens) // s.throughput.world)
                ranks = _every_rank(summary["monitor"])
                if ranks:
                    summary["monitor_ranks"] = ranks
                    summary["monitor_job"] = _job_energy(ranks, figures["tokens"] - start.tokens)
                summary["contention"] = contention.assess(summary["monitor"])
                contention.say(summary["contention"])
            del s
        if figures["failure"]:
            raise RunFailed(figures["failure"])
        if figures["interrupted_by"] is not None:
            signum = figures["interrupted_by"]
            where = figures["checkpoints"][-1] if figures["checkpoints"] else "no checkpoint (no run dir)"
            summary["status"] = "interrupted"
            summary["reason"] = f"{signal.Signals(signum).name} at step {figures['steps']}; saved {where}"
            raise Interrupted(signum, f"stopped by {summary['reason']}; continue with resume=auto or resume={where}")
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
    finally:
        if monitor is not None:
            monitor.close()
        sink.close()
        _release(device)
        summary["global_state_at_start"] = state_at_start
        summary["global_state_after"] = global_state()
        summary["wall_s"] = time.perf_counter() - t_start
        if cfg is not None:
            summary["config"] = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
        if main and run_dir is not None:
            write_json(run_dir / "summary.json", summary)
        if summary["status"] == "completed":
            _log_summary(summary)


def _every_rank(stats: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Under several ranks: each rank's ``stats`` tagged with its rank and host, gathered
    to rank 0 over the host (gloo) group, so no GPU waits; None on other ranks and alone."""
    if distributed.world_size() == 1:
        return None
    import socket

    return distributed.gather_to_rank0({"rank": distributed.rank(), "host": socket.gethostname(), **stats})


def _job_energy(ranks: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The whole job's energy: every rank's GPU, over every rank's tokens."""
    def total(key: str) -> float | None:  # None unless every rank measured it
        values = [r.get(key) for r in ranks]
        return None if any(v is None for v in values) else sum(values)

    energy = total("energy_j")
    return {"energy_j": energy, "joules_per_token": energy / tokens if energy is not None and tokens > 0 else None,
            "power_w_mean_sum": total("power_w_mean"), "ranks": len(ranks)}


def _release(device: torch.device | None) -> None:
    """Give back what this job took, so the next job of a sweep starts clean."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _log_summary(s: dict[str, Any]) -> None:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    mfu = s.get("mfu_median")
    log.info(
        f"done: {f(s.get('tokens_per_s_median'), ',.0f')} tok/s (median of {s.get('steady_steps')} steady steps), "
        + (f"MFU {100 * mfu:.1f}%" if mfu is not None else f"MFU n/a ({s.get('mfu_peak_source')})")
        + f", peak mem {f(s.get('peak_mem_mib'), ',.0f')} MiB, data-wait {f(s.get('data_wait_pct'), '.1f')}%, "
        f"first step {f(s.get('first_step_s'), '.2f')} s, train loss {f(s.get('final_train_loss'), '.4f')}, "
        f"val loss {f(s.get('final_val_loss'), '.4f')}"
    )
