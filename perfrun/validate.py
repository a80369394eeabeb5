"""What a type cannot say about a composed configuration: a batch size below one, a sequence
longer than the model, distributed options that do not fit the world, an MFU peak that is not
a number. Each rule raises ConfigError with one line: what, why, and the fix."""

from __future__ import annotations

import math
import re

from perfrun.config import (
    CHOICES,
    AblationConfig,
    ConfigError,
    DataConfig,
    DataLoaderConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    select,
)
from perfrun.device_conditions import ACTS_ON
from perfrun.model_schema import model_problem


def _check_batch_size(dl: DataLoaderConfig) -> None:
    """batch_size is an int >= 1 or "auto"; the auto options must make sense."""
    b = dl.batch_size
    if isinstance(b, int) and not isinstance(b, bool):
        if b < 1:
            raise ConfigError(
                f"dataloader.batch_size={b} must be >= 1 (or auto); set dataloader.batch_size=1 or more, "
                "or dataloader.batch_size=auto for the largest that fits"
            )
    elif b != "auto":
        shown = str(b).lower() if isinstance(b, bool) else b
        raise ConfigError(
            f"dataloader.batch_size={shown} is neither a whole number nor auto; set e.g. dataloader.batch_size=8, "
            "or dataloader.batch_size=auto for the largest that fits"
        )
    if dl.max_batch_size is not None and dl.max_batch_size < 1:
        raise ConfigError(f"dataloader.max_batch_size={dl.max_batch_size} must be >= 1; set it to null for no cap")
    if not 0.0 <= dl.batch_margin < 1.0:
        raise ConfigError(f"dataloader.batch_margin={dl.batch_margin} must be in [0, 1); set it to 0.1 (10% below the limit)")
    budget = dl.memory_budget_mib
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ConfigError(f"dataloader.memory_budget_mib={budget} must be a positive number of MiB, or null")


def validate(cfg: TrainConfig) -> None:
    """Check what the schema's types cannot; raise ConfigError with what, why and the fix."""
    _check_keys_and_choices(cfg)
    _check_minimums(cfg)
    _check_dataloader(cfg.dataloader)
    _check_model_and_data(cfg.model, cfg.data)
    _check_optim(cfg.optim)
    if cfg.checkpointing.name == "selective" and cfg.checkpointing.every_k < 1:
        raise ConfigError(
            "checkpointing=selective needs checkpointing.every_k>=1 (checkpoint every k-th block)"
        )
    check_distributed(cfg)
    _check_mfu_peak(str(cfg.mfu.peak))
    check_bounds(cfg)
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed} is outside what the random number generators take (0 to 2**32-1, numpy's "
                          "limit); choose a seed in that range")


def _check_keys_and_choices(cfg: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        value = select(cfg, key)
        if str(value) not in allowed:
            raise ConfigError(
                f"{key}={value} is not an option; choose one of {', '.join(allowed)}"
            )


_MINIMUMS = (  # key, lowest value, why (said in the error)
    ("dataloader.num_workers", 0, ""), ("accumulation.steps", 1, ""),
    ("loss.chunk_size", 1, " (tokens per chunk of loss=chunked)"),
    ("max_steps", 1, " (the number of optimizer steps to train)"), ("log_every", 1, ""), ("eval_every", 0, ""),
    ("eval_batches", 1, ""), ("timing_warmup_steps", 0, ""), ("model.n_layer", 1, ""), ("model.n_head", 1, ""),
    ("model.n_embd", 1, ""), ("model.block_size", 1, ""), ("monitor.every_n_steps", 0, ""),
    ("optim.warmup_steps", 0, ""), ("checkpointing.every_k", 0, ""), ("checkpoint.every_n_steps", 0, ""),
    ("checkpoint.keep_last", 1, ""), ("guard.max_bad_steps", 1, ""), ("profiler.start_step", 0, ""),
    ("profiler.warmup", 0, ""), ("profiler.active", 1, ""), ("profiler.snapshot_entries", 1, ""),
)


def _check_minimums(cfg: TrainConfig) -> None:
    _check_batch_size(cfg.dataloader)
    for key, low, why in _MINIMUMS:
        value = select(cfg, key)
        if value < low:
            raise ConfigError(f"{key}={value} must be >= {low}{why}; set {key}={max(low, 1)} or more")


def _check_dataloader(dl: DataLoaderConfig) -> None:
    if dl.prefetch_factor is not None:
        if dl.num_workers == 0:
            raise ConfigError(
                f"dataloader.prefetch_factor={dl.prefetch_factor} needs worker processes but "
                "dataloader.num_workers=0; set dataloader.num_workers>=1 or dataloader.prefetch_factor=null"
            )
        if dl.prefetch_factor < 1:
            raise ConfigError(
                f"dataloader.prefetch_factor={dl.prefetch_factor} must be >= 1; set it to 2 (torch's default)"
            )
    if dl.persistent_workers and dl.num_workers == 0:
        raise ConfigError(
            "dataloader.persistent_workers=true needs worker processes but dataloader.num_workers=0; "
            "set dataloader.num_workers>=1 or dataloader.persistent_workers=false"
        )


def _check_model_and_data(m: ModelConfig, data: DataConfig) -> None:
    problem = model_problem(m)
    if problem:
        raise ConfigError(problem)

    seq_len = data.seq_len
    if seq_len is not None:
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1; set data.seq_len=null for the model's block_size")
        if seq_len > m.block_size:
            raise ConfigError(
                f"data.seq_len={seq_len} is longer than model.block_size={m.block_size} "
                f"(model={m.name} has {m.block_size} positions); set data.seq_len<={m.block_size} "
                f"or model.block_size={seq_len}"
            )
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={data.val_fraction} must be in (0, 1); set it to 0.1")
    if data.vocab_size is not None and data.vocab_size < 2:
        raise ConfigError(f"data.vocab_size={data.vocab_size} must be >= 2")
    if data.name in ("text", "memmap") and not data.path:
        raise ConfigError(
            f"data={data.name} needs a file or folder; add data.path=/path/to/your/"
            + ("text" if data.name == "text" else "train.bin")
        )


def _check_optim(o: OptimConfig) -> None:
    for key in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
        value = getattr(o, key)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"optim.{key}={value} must be a finite number >= 0; check the value you typed")
    if o.lr == 0:
        raise ConfigError("optim.lr=0 trains nothing; set optim.lr to a positive number such as 6e-4")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        raise ConfigError(f"optim.beta1={o.beta1} and optim.beta2={o.beta2} must be in [0, 1)")


def _check_mfu_peak(peak: str) -> None:
    if peak not in ("datasheet", "measured"):
        try:
            ok = float(peak) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"mfu.peak={peak} is neither datasheet, measured nor a positive number of TFLOPS"
            )


def check_distributed(cfg: TrainConfig, world: int | None = None) -> None:
    """distributed and nproc against how this process was started (torchrun sets the
    WORLD_SIZE and LOCAL_WORLD_SIZE environment variables; a plain process has neither).
    ``world``: the size of the torchrun this process is about to start instead."""
    import os

    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    else:
        local = world
    if cfg.distributed not in CHOICES["distributed"]:
        raise ConfigError(f"distributed={cfg.distributed} is not an option; choose one of "
                          f"{', '.join(CHOICES['distributed'])}")
    if cfg.nproc < 1:
        raise ConfigError(f"nproc={cfg.nproc} must be >= 1; set nproc=1 or the number of processes to start")
    if cfg.distributed == "none":
        if cfg.nproc > 1:
            raise ConfigError(f"nproc={cfg.nproc} needs distributed=ddp or fsdp (one process trains alone); "
                              f"add distributed=ddp or set nproc=1")
        if world > 1:
            raise ConfigError(f"torchrun started {world} processes (WORLD_SIZE={world}) but distributed=none, so each "
                              "would train alone and write the same files; add distributed=ddp")
        return
    if world == 1 and cfg.nproc > 1:
        raise ConfigError(f"distributed={cfg.distributed} nproc={cfg.nproc}: this process was not started by torchrun; launch it "
                          f"with perfrun train (which starts torchrun) or torchrun --nproc_per_node={cfg.nproc} -m perfrun train")
    if world > 1 and cfg.nproc not in (1, local):
        raise ConfigError(f"nproc={cfg.nproc} but torchrun started {local} processes on this machine; drop nproc "
                          "under torchrun (its --nproc_per_node decides)")
    if cfg.dataloader.batch_size == "auto" and world > 1:
        raise ConfigError(f"dataloader.batch_size=auto is not supported with distributed={cfg.distributed} yet (each rank could "
                          "choose another batch); give a number, e.g. one that perfrun train found on one process")


#: The most micro-batches per optimizer step: GPT-2's 0.5M-token batch at batch_size=1 and
#: 1024 positions is 480 of them; more than this is a typo, not a recipe.
MAX_ACCUMULATION_STEPS = 1024


def check_bounds(cfg: TrainConfig) -> None:
    """accumulation.steps within :data:`MAX_ACCUMULATION_STEPS`; every ``ablation.*`` key within its bounds."""
    steps = cfg.accumulation.steps
    if steps > MAX_ACCUMULATION_STEPS:
        raise ConfigError(
            f"accumulation.steps={steps} is more than {MAX_ACCUMULATION_STEPS} micro-batches per optimizer step "
            f"(GPT-2's 0.5M-token batch at batch_size=1 is 480); set accumulation.steps to {MAX_ACCUMULATION_STEPS} "
            "or less, or raise dataloader.batch_size instead")
    check_ablation(cfg.ablation)


#: The most repeats of a rung: a median and its min-max range gain nothing from more, and the
#: ladder runs every repeat of every rung one after another.
MAX_REPEATS = 100
#: The longest time budget of a job or target of a ladder: a week; more is a typo (minutes for
#: seconds?), not a plan, and ``null`` says "no bound".
MAX_SECONDS = 7 * 24 * 3600.0
#: What ``ablation.kind`` may be: a rung file's place in the ladder ("" outside the ladder).
RUNG_KINDS = ("", "ladder", "without", "alternative", "tradeoff", "seed")
_RUNG_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_ablation(a: AblationConfig) -> None:
    """Every ``ablation.*`` key within its bounds, checked before a ladder calibrates or runs a
    job (:mod:`perfrun.ladder.bounds`) and again by each job."""
    for key, value, what, fix in (("repeats", a.repeats, "the runs of each rung", "3, or 1 for a single pass"),
                                  ("tradeoff_repeats", a.tradeoff_repeats, "the runs of a memory trade-off", "2")):
        if not 1 <= value <= MAX_REPEATS:
            raise ConfigError(f"ablation.{key}={value} is outside 1 to {MAX_REPEATS} ({what}, run one after another); "
                              f"set ablation.{key}={fix}")
    for key, seconds in (("budget_s", a.budget_s), ("target_s", a.target_s)):
        if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
            raise ConfigError(f"ablation.{key}={seconds} must be more than 0 and at most {MAX_SECONDS:.0f} seconds (a "
                              f"week); set e.g. ablation.{key}=600, or ablation.{key}=null for no bound")
    if a.kind not in RUNG_KINDS:
        raise ConfigError(f"ablation.kind={a.kind} is not a kind of rung; choose one of "
                          f"{', '.join(k for k in RUNG_KINDS if k)} (or leave it to the rung's file in conf/ablation/)")
    if a.acts_on not in ACTS_ON:
        raise ConfigError(f"ablation.acts_on={a.acts_on} is not an option; choose one of {', '.join(ACTS_ON)}")
    if a.rung and not _RUNG_NAME.fullmatch(a.rung):
        raise ConfigError(f"ablation.rung={a.rung!r} is not a rung's name (letters, digits, _ . -: its file's name "
                          "under conf/ablation/); leave it to the rung's file")
    if a.step < 0:
        raise ConfigError(f"ablation.step={a.step} must be >= 0 (a rung's place above the naive trainer, 0); "
                          "leave it to the rung's file in conf/ablation/")
